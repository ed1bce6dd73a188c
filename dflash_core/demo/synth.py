"""Synthetic chat data made by a program: step-by-step arithmetic, word problems, unit conversions, small
Python tasks and short facts. Every example is drawn from a seeded `random.Random`, so the data is reproducible.

Prompts vary the way users type them: 7-16 phrasings per task family (questions, commands, terse forms),
numbers as digits, words ("forty-eight") or with thousands commas, greetings and thanks, lower/upper case,
missing punctuation and typos (`surface`). Answers keep one step-by-step format per family, so a draft can
predict long runs of them whatever the wording of the question. The hand-written held-out prompts
(`handwritten_prompts.jsonl`) use wordings that no template here produces; `generatable_wordings` checks it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from dflash_core.demo.phrasing import (
    CONTAINERS,
    FACTS,
    GREETINGS,
    ITEMS,
    NAMES,
    UNITS,
    num,
    number_words,
    pick,
    surface,
)

Message = dict[str, str]

def addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    A, B = num(rng, a), num(rng, b)
    q = pick(rng, [f"What is {A} + {B}?", f"Add {A} and {B}.", f"Compute {A} + {B}.",
                    f"What is the sum of {A} and {B}?", f"Please calculate {A} plus {B}.", f"{A} + {B} = ?",
                    f"{A}+{B}", f"What's {A} plus {B}?", f"How much is {A} and {B} together?",
                    f"Find the total of {A} and {B}.", f"I need the sum of {A} and {B}.",
                    f"Could you add {A} to {B} for me?", f"{A} plus {B}", f"If I add {A} and {B}, what do I get?",
                    f"sum of {A} and {B}?", f"Tell me what {A} + {B} equals."])
    ones = a % 10 + b % 10
    rest = (a - a % 10) + (b - b % 10)
    ans = pick(rng, [
        f"Let's add step by step.\nFirst the tens and hundreds: {a - a % 10} + {b - b % 10} = {rest}.\n"
        f"Then the ones: {a % 10} + {b % 10} = {ones}.\nFinally {rest} + {ones} = {a + b}.\n"
        f"So {a} + {b} = {a + b}.",
        f"We split the numbers into parts.\n{a} = {a - a % 10} + {a % 10} and {b} = {b - b % 10} + {b % 10}.\n"
        f"Adding the large parts gives {rest}, and adding the ones gives {ones}.\n"
        f"Together that is {rest} + {ones} = {a + b}.\nThe answer is {a + b}.",
        f"{a} + {b} = {a + b}.\nCheck: {a + b} - {b} = {a}, which matches.",
    ])
    return q, ans


def subtraction(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(50, 999)
    b = rng.randint(10, a - 1)
    A, B = num(rng, a), num(rng, b)
    q = pick(rng, [f"What is {A} - {B}?", f"Subtract {B} from {A}.", f"Compute {A} minus {B}.",
                    f"What is the difference between {A} and {B}?", f"{A} - {B} = ?", f"{A}-{B}",
                    f"What's {A} minus {B}?", f"How much is {A} take away {B}?", f"Take {B} away from {A}.",
                    f"If I have {A} and remove {B}, how many are left?", f"Find {A} minus {B}.",
                    f"Could you subtract {B} from {A}?", f"{A} minus {B}", f"I need {A} minus {B}.",
                    f"How much is left when {B} is taken from {A}?", f"Calculate {A} - {B} please."])
    step = b - b % 10
    ans = pick(rng, [
        f"Let's subtract in two steps.\nFirst take away {step}: {a} - {step} = {a - step}.\n"
        f"Then take away {b % 10}: {a - step} - {b % 10} = {a - b}.\nSo {a} - {b} = {a - b}.",
        f"{a} - {b} = {a - b}.\nCheck by adding back: {a - b} + {b} = {a}, so the answer is {a - b}.",
    ])
    return q, ans


def multiplication(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(11, 99), rng.randint(2, 19)
    A, B = num(rng, a), num(rng, b)
    q = pick(rng, [f"What is {A} x {B}?", f"Multiply {A} by {B}.", f"Compute {A} times {B}.",
                    f"What is the product of {A} and {B}?", f"What is {A} * {B}?", f"{A} * {B} = ?", f"{A}x{B}",
                    f"What's {A} times {B}?", f"How much is {A} multiplied by {B}?",
                    f"Find the product of {A} and {B}.",
                    f"Could you multiply {A} and {B}?", f"{A} times {B}", f"I need {A} times {B}.",
                    f"What do you get when you multiply {A} by {B}?", f"Calculate {A} * {B} please.",
                    f"{B} groups of {A}: how many is that?"])
    t, o = a - a % 10, a % 10
    ans = pick(rng, [
        f"Break {a} into {t} + {o}.\n{t} x {b} = {t * b}.\n{o} x {b} = {o * b}.\n"
        f"Add the parts: {t * b} + {o * b} = {a * b}.\nSo {a} x {b} = {a * b}.",
        f"We can use the distributive property.\n{a} x {b} = ({t} + {o}) x {b} = {t * b} + {o * b} = {a * b}.\n"
        f"The product is {a * b}.",
    ])
    return q, ans


def division(rng: random.Random) -> tuple[str, str]:
    b, quot = rng.randint(2, 12), rng.randint(3, 60)
    rem = rng.choice([0, 0, rng.randint(1, b - 1)])
    a = b * quot + rem
    A, B = num(rng, a), num(rng, b)
    q = pick(rng, [f"What is {A} divided by {B}?", f"Divide {A} by {B}.", f"Compute {A} / {B}.",
                    f"How many times does {B} go into {A}?", f"{A} / {B} = ?", f"{A}/{B}",
                    f"What's {A} divided by {B}?", f"How much is {A} split {B} ways?",
                    f"Could you divide {A} by {B}?", f"{A} divided by {B}", f"I need {A} divided by {B}.",
                    f"What do you get when you divide {A} by {B}?", f"Find the quotient of {A} and {B}.",
                    f"Calculate {A} / {B} please.", f"How many groups of {B} fit in {A}?"])
    if rem == 0:
        ans = (f"We need a number that gives {a} when multiplied by {b}.\n{b} x {quot} = {a}.\n"
               f"So {a} / {b} = {quot}, with no remainder.")
    else:
        ans = (f"{b} x {quot} = {b * quot}, and {b} x {quot + 1} = {b * (quot + 1)} is too big.\n"
               f"The remainder is {a} - {b * quot} = {rem}.\nSo {a} divided by {b} is {quot} with remainder {rem}.")
    return q, ans


def word_buy(rng: random.Random) -> tuple[str, str]:
    name, item = pick(rng, NAMES), pick(rng, ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 30), rng.randint(1, 20)
    c = min(c, a + b)
    A, B, C = num(rng, a), num(rng, b), num(rng, c)
    q = pick(rng, [
        f"{name} has {A} {item}. {name} gets {B} more and then gives away {C}. How many {item} does {name} have now?",
        f"{name} had {A} {item}, got {B} more, then gave {C} away. How many {item} are left?",
        f"Start with {A} {item}. Add {B}, then remove {C}. How many {item} are there?",
        f"{name} owns {A} {item}. A friend gives {name} {B} more, and {name} gives {C} to a neighbor. "
        f"How many {item} does {name} have?",
        f"If {name} has {A} {item}, receives {B} more and gives away {C}, how many {item} does {name} end up with?",
        f"{name} collects {A} {item} and finds {B} more. Later {name} loses {C}. How many {item} now?",
        f"{A} {item} plus {B} more minus {C} given away. how many {item}?",
        f"There were {A} {item} in the room. Someone brought {B} more and {C} were taken out. "
        f"How many {item} are in the room?",
    ])
    ans = (f"{name} starts with {a} {item}.\nAfter getting {b} more: {a} + {b} = {a + b}.\n"
           f"After giving away {c}: {a + b} - {c} = {a + b - c}.\n{name} has {a + b - c} {item} now.")
    return q, ans


def word_groups(rng: random.Random) -> tuple[str, str]:
    name, item, box = pick(rng, NAMES), pick(rng, ITEMS), pick(rng, CONTAINERS)
    n, k = rng.randint(2, 12), rng.randint(3, 25)
    N, K = num(rng, n), num(rng, k)
    q = pick(rng, [f"There are {N} {box} with {K} {item} in each. How many {item} are there in total?",
                    f"{name} fills {N} {box} with {K} {item} each. How many {item} did {name} use?",
                    f"{N} {box}, {K} {item} per box. Total?",
                    f"Each of {N} {box} holds {K} {item}. How many {item} altogether?",
                    f"If one of the {box} has {K} {item}, how many {item} are in {N} {box}?",
                    f"{name} has {N} {box}. Every one contains {K} {item}. What is the total number of {item}?",
                    f"How many {item} are in {N} {box} if each has {K}?",
                    f"{name} packs {K} {item} into each of {N} {box}. How many {item} is that in all?"])
    ans = (f"Each of the {n} {box} holds {k} {item}.\nTo find the total we multiply: {n} x {k} = {n * k}.\n"
           f"There are {n * k} {item} in total.")
    return q, ans


def word_money(rng: random.Random) -> tuple[str, str]:
    name, item = pick(rng, NAMES), pick(rng, ITEMS)
    price, n = rng.randint(2, 15), rng.randint(2, 9)
    paid = price * n + rng.randint(0, 20)
    P, N, M = num(rng, price, 0.0), num(rng, n), num(rng, paid, 0.0)
    q = pick(rng, [
        f"{name} buys {N} {item} for ${P} each and pays with ${M}. How much change does {name} get?",
        f"{item.capitalize()} cost ${P} each. {name} buys {N} and hands over ${M}. What is the change?",
        f"If {N} {item} cost ${P} apiece and {name} pays ${M}, how much money comes back?",
        f"{name} pays ${M} for {N} {item} at ${P} each. How much change?",
        f"How much change does {name} get from ${M} after buying {N} {item} at {P} dollars each?",
        f"{name} has ${M} and spends it on {N} {item} costing ${P} each. How much is left?",
        f"{N} {item} at ${P} each, paid with ${M}. change?",
    ])
    ans = (f"First find the cost: {n} x ${price} = ${n * price}.\n"
           f"Then subtract it from what {name} paid: ${paid} - ${n * price} = ${paid - n * price}.\n"
           f"{name} gets ${paid - n * price} in change.")
    return q, ans


def word_speed(rng: random.Random) -> tuple[str, str]:
    name = pick(rng, NAMES)
    speed, hours = rng.randint(3, 90), rng.randint(2, 9)
    vehicle = pick(rng, ["bike", "car", "train", "boat", "bus"])
    S, H = num(rng, speed), num(rng, hours)
    unit = pick(rng, ["km per hour", "km/h", "kilometers per hour", "km an hour"])
    q = pick(rng, [
        f"{name} travels by {vehicle} at {S} {unit} for {H} hours. How far does {name} go?",
        f"A {vehicle} moves at {S} {unit}. How far does it get in {H} hours?",
        f"How many km does {name} cover riding a {vehicle} for {H} hours at {S} {unit}?",
        f"{name}'s {vehicle} goes {S} {unit}. What distance is covered after {H} hours?",
        f"If a {vehicle} keeps a speed of {S} {unit} for {H} hours, what distance does it travel?",
        f"{S} {unit} for {H} hours by {vehicle}: how far is that?",
        f"{name} drives a {vehicle} for {H} hours at {S} {unit}. What is the distance?",
    ])
    ans = (f"Distance is speed times time.\nSpeed = {speed} km per hour, time = {hours} hours.\n"
           f"Distance = {speed} x {hours} = {speed * hours} km.\n{name} travels {speed * hours} km.")
    return q, ans


def word_share(rng: random.Random) -> tuple[str, str]:
    item = pick(rng, ITEMS)
    people, each = rng.randint(2, 9), rng.randint(2, 15)
    total = people * each
    names = rng.sample(NAMES, 2)
    T, P = num(rng, total), num(rng, people)
    q = pick(rng, [
        f"{names[0]} and {names[1]} want to share {T} {item} equally among {P} friends. "
        f"How many {item} does each friend get?",
        f"{T} {item} are split evenly between {P} friends. How many does each friend get?",
        f"How many {item} does each of {P} friends get if {T} {item} are shared equally?",
        f"{names[0]} divides {T} {item} fairly among {P} friends. How many {item} per friend?",
        f"Share {T} {item} equally among {P} friends. How many each?",
        f"If {P} friends share {T} {item} so that everyone gets the same, how many {item} does each get?",
        f"{names[0]} has {T} {item} to hand out to {P} friends, the same number to each. How many {item} each?",
    ])
    ans = (f"We divide the {item} equally: {total} / {people} = {each}.\nCheck: {people} x {each} = {total}.\n"
           f"Each friend gets {each} {item}.")
    return q, ans


def _conversion_question(rng: random.Random, v: str, src: str, dst: str) -> str:
    # Never the bare "Convert {v} {src} to {dst}." (a hand-written held-out wording).
    return pick(rng, [f"Convert {v} {src} into {dst}.", f"How many {dst} are in {v} {src}?",
                       f"What is {v} {src} in {dst}?", f"Can you convert {v} {src} to {dst}?",
                       f"{v} {src} to {dst}", f"{v} {src} in {dst}?", f"How many {dst} is {v} {src}?",
                       f"Express {v} {src} in {dst}.", f"I have {v} {src}. How many {dst} is that?",
                       f"Change {v} {src} to {dst}.", f"please convert {v} {src} to {dst}",
                       f"What does {v} {src} come to in {dst}?", f"Turn {v} {src} into {dst}."])


def conversion(rng: random.Random) -> tuple[str, str]:
    unit, units, other, others, f = UNITS[rng.randrange(len(UNITS))]
    if rng.random() < 0.6:
        v = rng.randint(2, 60)
        q = _conversion_question(rng, num(rng, v), units, others)
        ans = pick(rng, [
            f"There are {f} {others} in one {unit}.\nSo {v} {units} = {v} x {f} = {v * f} {others}.",
            f"One {unit} equals {f} {others}.\nMultiply: {v} x {f} = {v * f}.\nThe answer is {v * f} {others}.",
        ])
    else:
        n = rng.randint(2, 40)
        v = n * f
        q = _conversion_question(rng, num(rng, v), others, units)
        ans = (f"One {unit} is {f} {others}, so we divide by {f}.\n{v} / {f} = {n}.\n"
               f"So {v} {others} is {n} {units}.")
    return q, ans


def temperature(rng: random.Random) -> tuple[str, str]:
    c = rng.choice(range(-20, 105, 5))
    fah = c * 9 // 5 + 32
    if rng.random() < 0.5:
        q = pick(rng, [f"Convert {c} degrees Celsius to Fahrenheit.", f"What is {c} C in F?",
                        f"{c} degrees C to F", f"How much is {c} Celsius in Fahrenheit?", f"{c}°C in Fahrenheit?",
                        f"Change {c} degrees Celsius into Fahrenheit.",
                        f"What temperature in Fahrenheit is {c} degrees Celsius?",
                        f"It is {c} degrees Celsius outside. What is that in Fahrenheit?",
                        f"turn {c} celsius into fahrenheit"])
        ans = (f"The formula is F = C x 9 / 5 + 32.\n{c} x 9 / 5 = {c * 9 // 5}.\n{c * 9 // 5} + 32 = {fah}.\n"
               f"So {c} degrees Celsius is {fah} degrees Fahrenheit.")
    else:
        q = pick(rng, [f"Convert {fah} degrees Fahrenheit to Celsius.", f"What is {fah} F in C?",
                        f"{fah} degrees F to C", f"How much is {fah} Fahrenheit in Celsius?",
                        f"{fah}°F in Celsius?", f"Change {fah} degrees Fahrenheit into Celsius.",
                        f"What temperature in Celsius is {fah} degrees Fahrenheit?",
                        f"The thermometer says {fah} degrees Fahrenheit. What is that in Celsius?",
                        f"turn {fah} fahrenheit into celsius"])
        ans = (f"The formula is C = (F - 32) x 5 / 9.\n{fah} - 32 = {fah - 32}.\n{fah - 32} x 5 / 9 = {c}.\n"
               f"So {fah} degrees Fahrenheit is {c} degrees Celsius.")
    return q, ans


def _fn_name(rng: random.Random, base: str) -> str:
    return pick(rng, [base, f"get_{base}", f"compute_{base}", f"{base}_of"])


# Per code task: (third-person description, base form) pairs; the first pair is the original wording.
CODE_DESCS: list[list[tuple[str, str]]] = [
    [("returns the sum of a list of numbers", "sum a list of numbers"),
     ("adds up all the numbers in a list", "add up all the numbers in a list")],
    [("finds the largest number in a list", "find the largest number in a list"),
     ("returns the maximum of a list", "get the maximum of a list")],
    [("reverses a string", "reverse a string"), ("returns a string backwards", "return a string backwards"),
     ("flips the characters of a string around", "flip the characters of a string around")],
    [("checks whether a number is even", "check whether a number is even"),
     ("tells if a number is even", "tell if a number is even")],
    [("counts the vowels in a string", "count the vowels in a string"),
     ("returns how many vowels a string has", "find how many vowels a string has")],
    [("computes the factorial of n", "compute the factorial of n"),
     ("returns n factorial", "calculate n factorial")],
    [("returns the first n multiples of {k}", "list the first n multiples of {k}"),
     ("gives the first n multiples of {k}", "get the first n multiples of {k}")],
    [("returns the average of a list", "average a list"),
     ("computes the mean of a list of numbers", "compute the mean of a list of numbers")],
    [("counts how often each word appears in a text", "count how often each word appears in a text"),
     ("returns a dictionary of word counts for a text", "build a dictionary of word counts for a text")],
    [("checks whether a word is a palindrome", "check whether a word is a palindrome"),
     ("tests if a word reads the same backwards", "test if a word reads the same backwards")],
]


def code_task(rng: random.Random) -> tuple[str, str]:
    var = pick(rng, ["numbers", "values", "items", "data", "nums", "xs"])
    kind = rng.randrange(10)
    k = rng.randint(2, 10)
    if kind == 0:
        name = _fn_name(rng, "total")
        code = f"def {name}({var}):\n    result = 0\n    for x in {var}:\n        result += x\n    return result"
        note = f"It starts at 0 and adds each number. For example, {name}([1, 2, 3]) returns 6."
    elif kind == 1:
        name = _fn_name(rng, "largest")
        code = (f"def {name}({var}):\n    best = {var}[0]\n    for x in {var}[1:]:\n        if x > best:\n"
                f"            best = x\n    return best")
        note = f"It keeps the largest value seen so far. {name}([4, 9, 2]) returns 9."
    elif kind == 2:
        name = _fn_name(rng, "reverse")
        code = f"def {name}(text):\n    return text[::-1]"
        note = f"The slice [::-1] walks the string backwards, so {name}(\"abc\") returns \"cba\"."
    elif kind == 3:
        name = _fn_name(rng, "is_even")
        code = f"def {name}(n):\n    return n % 2 == 0"
        note = f"A number is even when the remainder after dividing by 2 is 0. {name}(4) is True."
    elif kind == 4:
        name = _fn_name(rng, "count_vowels")
        code = (f"def {name}(text):\n    count = 0\n    for ch in text.lower():\n        if ch in \"aeiou\":\n"
                f"            count += 1\n    return count")
        note = f"It lowers the text and counts each vowel. {name}(\"Banana\") returns 3."
    elif kind == 5:
        name = _fn_name(rng, "factorial")
        code = f"def {name}(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result"
        note = f"It multiplies 2, 3, ..., n together. {name}(5) returns 120."
    elif kind == 6:
        name = _fn_name(rng, "multiples")
        code = f"def {name}(n):\n    return [{k} * i for i in range(1, n + 1)]"
        note = (f"The list comprehension builds {k}, {2 * k}, {3 * k} and so on. "
                f"{name}(3) returns [{k}, {2 * k}, {3 * k}].")
    elif kind == 7:
        name = _fn_name(rng, "average")
        code = f"def {name}({var}):\n    if not {var}:\n        return 0.0\n    return sum({var}) / len({var})"
        note = f"It returns 0.0 for an empty list, otherwise the sum divided by the length. {name}([2, 4]) is 3.0."
    elif kind == 8:
        name = _fn_name(rng, "word_count")
        code = (f"def {name}(text):\n    counts = {{}}\n    for word in text.split():\n"
                f"        counts[word] = counts.get(word, 0) + 1\n    return counts")
        note = (f"It splits the text on spaces and keeps a dictionary of counts. "
                f"{name}(\"a b a\") returns {{'a': 2, 'b': 1}}.")
    else:
        name = _fn_name(rng, "is_palindrome")
        code = f"def {name}(word):\n    word = word.lower()\n    return word == word[::-1]"
        note = f"A palindrome reads the same backwards. {name}(\"Level\") returns True."
    descs = CODE_DESCS[kind]
    desc, base = (s.format(k=k) for s in descs[0 if rng.random() < 0.4 else rng.randrange(len(descs))])
    # Never "Write a Python function that {desc}." without a name (a hand-written held-out wording).
    q = pick(rng, [f"Write a Python function {name} that {desc}.", f"Implement {name} in Python: it {desc}.",
                    f"Can you write a Python function called {name} that {desc}?",
                    f"I need Python code to {base}.", f"python: {base}", f"How do I {base} in Python?",
                    f"Write a function in Python that {desc}.", f"Show me a Python function to {base}.",
                    f"Create a function named {name} which {desc}.", f"Give me Python code that {desc}.",
                    f"Please write {name}(), a function that {desc}.", f"def {name}: {base}",
                    f"Could you code a Python function to {base}?", f"Python function to {base}?"])
    intro = pick(rng, ["Here is a simple solution:", "Here is one way to do it:", "Sure. Here is the function:"])
    return q, f"{intro}\n```python\n{code}\n```\n{note}"


FACT_VARIANTS = ["{q}", "{q}", "{lq}", "Tell me: {lq}", "Quick question: {lq}", "{q} Thanks!"]


def fact(rng: random.Random) -> tuple[str, str]:
    q, a = FACTS[rng.randrange(len(FACTS))]
    return pick(rng, FACT_VARIANTS).format(q=q, lq=q[0].lower() + q[1:]), a


def greeting(rng: random.Random) -> tuple[str, str]:
    return GREETINGS[rng.randrange(len(GREETINGS))]


TASKS: list[tuple[Callable[[random.Random], tuple[str, str]], float]] = [
    (addition, 1.0), (subtraction, 0.8), (multiplication, 1.0), (division, 0.8), (word_buy, 0.8),
    (word_groups, 0.8), (word_money, 0.7), (word_speed, 0.6), (word_share, 0.6), (conversion, 1.2),
    (temperature, 0.5), (code_task, 1.4), (fact, 0.25), (greeting, 0.1),
]


def make_example(rng: random.Random) -> list[Message]:
    """One chat: [user, assistant]."""
    fns, weights = zip(*TASKS)
    fn = rng.choices(fns, weights=weights)[0]
    q, a = fn(rng)
    if fn is not greeting:
        q = surface(rng, q)
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def examples(seed: int, exclude: set[str] | None = None) -> Iterator[list[Message]]:
    """Endless stream of chats from `seed`, skipping any whose prompt is in `exclude`."""
    rng = random.Random(seed)
    while True:
        ex = make_example(rng)
        if exclude and ex[0]["content"] in exclude:
            continue
        yield ex


def heldout_prompts(n: int = 32, seed: int = 424242, exclude_fixed: bool = True) -> list[list[Message]]:
    """`n` distinct held-out chats (prompt + reference answer); fixed-answer tasks (facts, greetings) are
    skipped since those prompts also occur in training."""
    rng = random.Random(seed)
    out: list[list[Message]] = []
    seen: set[str] = set()
    fns, weights = zip(*[(f, w) for f, w in TASKS if not (exclude_fixed and f in (fact, greeting))])
    while len(out) < n:
        q, a = rng.choices(fns, weights=weights)[0](rng)
        q = surface(rng, q)
        if q in seen:
            continue
        seen.add(q)
        out.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return out


_NUMBER_RE = None


def wording(text: str) -> str:
    """A prompt with its numbers (digits, thousands commas, number words) replaced by '#'."""
    import re

    global _NUMBER_RE
    if _NUMBER_RE is None:
        words = sorted({number_words(n) for n in range(100)}, key=len, reverse=True)
        _NUMBER_RE = re.compile(r"\d[\d,]*\d|\d|\b(?:" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE)
    return _NUMBER_RE.sub("#", text)


def generatable_wordings(prompts: list[str], n: int = 300_000, seed: int = 0) -> dict[str, str]:
    """Prompts among `prompts` whose wording (numbers aside) occurs in `n` generated examples, mapped to the
    generated prompt that matched; also flags exact matches. Empty for the hand-written held-out set."""
    targets = {wording(p): p for p in prompts}
    exact = set(prompts)
    hits: dict[str, str] = {}
    gen = examples(seed)
    for _ in range(n):
        q = next(gen)[0]["content"]
        if q in exact:
            hits[q] = q
        w = wording(q)
        if w in targets:
            hits[targets[w]] = q
    return hits
