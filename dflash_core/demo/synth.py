"""Synthetic chat data made by a program: step-by-step arithmetic, word problems, unit conversions, small
Python tasks and short facts. Every example is drawn from a seeded `random.Random`, so the data is reproducible.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

Message = dict[str, str]

NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe"]
ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "stamps", "shells", "cards", "coins",
         "oranges", "balloons", "candles", "buttons", "eggs", "plants", "toy cars", "cupcakes"]
CONTAINERS = ["boxes", "bags", "baskets", "jars", "crates", "shelves", "trays"]

# (unit, plural, other unit, plural, factor): 1 unit = factor other units
UNITS = [
    ("kilometer", "kilometers", "meter", "meters", 1000),
    ("meter", "meters", "centimeter", "centimeters", 100),
    ("centimeter", "centimeters", "millimeter", "millimeters", 10),
    ("kilogram", "kilograms", "gram", "grams", 1000),
    ("liter", "liters", "milliliter", "milliliters", 1000),
    ("hour", "hours", "minute", "minutes", 60),
    ("minute", "minutes", "second", "seconds", 60),
    ("day", "days", "hour", "hours", 24),
    ("week", "weeks", "day", "days", 7),
    ("year", "years", "month", "months", 12),
    ("foot", "feet", "inch", "inches", 12),
    ("yard", "yards", "foot", "feet", 3),
    ("gallon", "gallons", "quart", "quarts", 4),
    ("dozen", "dozens", "item", "items", 12),
]

FACTS = [
    ("What is the capital of France?", "The capital of France is Paris. It is also the largest city in the country."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo, one of the largest cities in the world."),
    ("What is the capital of Italy?", "The capital of Italy is Rome, a city with a history of more than two "
     "thousand years."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa, in the province of Ontario."),
    ("What is the capital of Kenya?", "The capital of Kenya is Nairobi."),
    ("What is the capital of Brazil?", "The capital of Brazil is Brasilia, a planned city built in the 1950s."),
    ("How many days are in a leap year?", "A leap year has 366 days. The extra day is February 29."),
    ("How many sides does a hexagon have?", "A hexagon has 6 sides and 6 corners."),
    ("How many sides does a triangle have?", "A triangle has 3 sides. Its three angles add up to 180 degrees."),
    ("What is the boiling point of water?", "At sea level, water boils at 100 degrees Celsius, which is 212 "
     "degrees Fahrenheit."),
    ("What is the freezing point of water?", "Water freezes at 0 degrees Celsius, or 32 degrees Fahrenheit."),
    ("What is a prime number?", "A prime number is a whole number greater than 1 whose only divisors are 1 and "
     "itself. For example, 2, 3, 5, 7 and 11 are prime."),
    ("What is an even number?", "An even number is a whole number that can be divided by 2 with no remainder, "
     "such as 2, 4, 10 or 36."),
    ("What does a Python list do?", "A Python list stores an ordered sequence of values. You can add items with "
     "append, read them by index and loop over them with a for loop."),
    ("What is a dictionary in Python?", "A dictionary maps keys to values. You write it with braces, for example "
     "{\"a\": 1}, and look a value up with d[key] or d.get(key)."),
    ("What is a function?", "A function is a named block of code that takes inputs, does some work and can "
     "return a result. In Python you define one with the def keyword."),
    ("What is the largest planet in the solar system?", "Jupiter is the largest planet in the solar system. It "
     "is a gas giant, more than eleven times wider than Earth."),
    ("How many continents are there?", "There are seven continents: Africa, Antarctica, Asia, Australia, Europe, "
     "North America and South America."),
    ("What is photosynthesis?", "Photosynthesis is the process plants use to turn light, water and carbon "
     "dioxide into sugar and oxygen."),
    ("Why is the sky blue?", "Sunlight is scattered by the air, and blue light is scattered much more than red "
     "light. That scattered blue light reaches our eyes from every direction, so the sky looks blue."),
]

GREETINGS = [
    ("Hello!", "Hello! How can I help you today? I can work through arithmetic, convert units, solve word "
     "problems or write small Python functions."),
    ("Hi, who are you?", "I am a small demo assistant. I answer simple math questions step by step, convert "
     "units and write short Python code."),
    ("What can you do?", "I can add, subtract, multiply and divide numbers step by step, solve short word "
     "problems, convert between units and write small Python functions."),
    ("Thanks!", "You are welcome! Let me know if you have another question."),
]


def _pick(rng: random.Random, options: list[str]) -> str:
    return options[rng.randrange(len(options))]


def addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    q = _pick(rng, [f"What is {a} + {b}?", f"Add {a} and {b}.", f"Compute {a} + {b}.",
                    f"What is the sum of {a} and {b}?", f"Please calculate {a} plus {b}."])
    ones = a % 10 + b % 10
    rest = (a - a % 10) + (b - b % 10)
    ans = _pick(rng, [
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
    q = _pick(rng, [f"What is {a} - {b}?", f"Subtract {b} from {a}.", f"Compute {a} minus {b}.",
                    f"What is the difference between {a} and {b}?"])
    step = b - b % 10
    ans = _pick(rng, [
        f"Let's subtract in two steps.\nFirst take away {step}: {a} - {step} = {a - step}.\n"
        f"Then take away {b % 10}: {a - step} - {b % 10} = {a - b}.\nSo {a} - {b} = {a - b}.",
        f"{a} - {b} = {a - b}.\nCheck by adding back: {a - b} + {b} = {a}, so the answer is {a - b}.",
    ])
    return q, ans


def multiplication(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(11, 99), rng.randint(2, 19)
    q = _pick(rng, [f"What is {a} x {b}?", f"Multiply {a} by {b}.", f"Compute {a} times {b}.",
                    f"What is the product of {a} and {b}?", f"What is {a} * {b}?"])
    t, o = a - a % 10, a % 10
    ans = _pick(rng, [
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
    q = _pick(rng, [f"What is {a} divided by {b}?", f"Divide {a} by {b}.", f"Compute {a} / {b}.",
                    f"How many times does {b} go into {a}?"])
    if rem == 0:
        ans = (f"We need a number that gives {a} when multiplied by {b}.\n{b} x {quot} = {a}.\n"
               f"So {a} / {b} = {quot}, with no remainder.")
    else:
        ans = (f"{b} x {quot} = {b * quot}, and {b} x {quot + 1} = {b * (quot + 1)} is too big.\n"
               f"The remainder is {a} - {b * quot} = {rem}.\nSo {a} divided by {b} is {quot} with remainder {rem}.")
    return q, ans


def word_buy(rng: random.Random) -> tuple[str, str]:
    name, item = _pick(rng, NAMES), _pick(rng, ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 30), rng.randint(1, 20)
    c = min(c, a + b)
    q = (f"{name} has {a} {item}. {name} gets {b} more and then gives away {c}. "
         f"How many {item} does {name} have now?")
    ans = (f"{name} starts with {a} {item}.\nAfter getting {b} more: {a} + {b} = {a + b}.\n"
           f"After giving away {c}: {a + b} - {c} = {a + b - c}.\n{name} has {a + b - c} {item} now.")
    return q, ans


def word_groups(rng: random.Random) -> tuple[str, str]:
    name, item, box = _pick(rng, NAMES), _pick(rng, ITEMS), _pick(rng, CONTAINERS)
    n, k = rng.randint(2, 12), rng.randint(3, 25)
    q = _pick(rng, [f"There are {n} {box} with {k} {item} in each. How many {item} are there in total?",
                    f"{name} fills {n} {box} with {k} {item} each. How many {item} did {name} use?"])
    ans = (f"Each of the {n} {box} holds {k} {item}.\nTo find the total we multiply: {n} x {k} = {n * k}.\n"
           f"There are {n * k} {item} in total.")
    return q, ans


def word_money(rng: random.Random) -> tuple[str, str]:
    name, item = _pick(rng, NAMES), _pick(rng, ITEMS)
    price, n = rng.randint(2, 15), rng.randint(2, 9)
    paid = price * n + rng.randint(0, 20)
    q = (f"{name} buys {n} {item} for ${price} each and pays with ${paid}. How much change does {name} get?")
    ans = (f"First find the cost: {n} x ${price} = ${n * price}.\n"
           f"Then subtract it from what {name} paid: ${paid} - ${n * price} = ${paid - n * price}.\n"
           f"{name} gets ${paid - n * price} in change.")
    return q, ans


def word_speed(rng: random.Random) -> tuple[str, str]:
    name = _pick(rng, NAMES)
    speed, hours = rng.randint(3, 90), rng.randint(2, 9)
    vehicle = _pick(rng, ["bike", "car", "train", "boat", "bus"])
    q = f"{name} travels by {vehicle} at {speed} km per hour for {hours} hours. How far does {name} go?"
    ans = (f"Distance is speed times time.\nSpeed = {speed} km per hour, time = {hours} hours.\n"
           f"Distance = {speed} x {hours} = {speed * hours} km.\n{name} travels {speed * hours} km.")
    return q, ans


def word_share(rng: random.Random) -> tuple[str, str]:
    item = _pick(rng, ITEMS)
    people, each = rng.randint(2, 9), rng.randint(2, 15)
    total = people * each
    names = rng.sample(NAMES, 2)
    q = (f"{names[0]} and {names[1]} want to share {total} {item} equally among {people} friends. "
         f"How many {item} does each friend get?")
    ans = (f"We divide the {item} equally: {total} / {people} = {each}.\nCheck: {people} x {each} = {total}.\n"
           f"Each friend gets {each} {item}.")
    return q, ans


def conversion(rng: random.Random) -> tuple[str, str]:
    unit, units, other, others, f = UNITS[rng.randrange(len(UNITS))]
    if rng.random() < 0.6:
        v = rng.randint(2, 60)
        q = _pick(rng, [f"Convert {v} {units} to {others}.", f"How many {others} are in {v} {units}?",
                        f"What is {v} {units} in {others}?"])
        ans = _pick(rng, [
            f"There are {f} {others} in one {unit}.\nSo {v} {units} = {v} x {f} = {v * f} {others}.",
            f"One {unit} equals {f} {others}.\nMultiply: {v} x {f} = {v * f}.\nThe answer is {v * f} {others}.",
        ])
    else:
        n = rng.randint(2, 40)
        v = n * f
        q = _pick(rng, [f"Convert {v} {others} to {units}.", f"How many {units} are {v} {others}?",
                        f"What is {v} {others} in {units}?"])
        ans = (f"One {unit} is {f} {others}, so we divide by {f}.\n{v} / {f} = {n}.\n"
               f"So {v} {others} is {n} {units}.")
    return q, ans


def temperature(rng: random.Random) -> tuple[str, str]:
    c = rng.choice(range(-20, 105, 5))
    fah = c * 9 // 5 + 32
    if rng.random() < 0.5:
        q = f"Convert {c} degrees Celsius to Fahrenheit."
        ans = (f"The formula is F = C x 9 / 5 + 32.\n{c} x 9 / 5 = {c * 9 // 5}.\n{c * 9 // 5} + 32 = {fah}.\n"
               f"So {c} degrees Celsius is {fah} degrees Fahrenheit.")
    else:
        q = f"Convert {fah} degrees Fahrenheit to Celsius."
        ans = (f"The formula is C = (F - 32) x 5 / 9.\n{fah} - 32 = {fah - 32}.\n{fah - 32} x 5 / 9 = {c}.\n"
               f"So {fah} degrees Fahrenheit is {c} degrees Celsius.")
    return q, ans


def _fn_name(rng: random.Random, base: str) -> str:
    return _pick(rng, [base, f"get_{base}", f"compute_{base}", f"{base}_of"])


def code_task(rng: random.Random) -> tuple[str, str]:
    var = _pick(rng, ["numbers", "values", "items", "data", "nums", "xs"])
    kind = rng.randrange(10)
    if kind == 0:
        name = _fn_name(rng, "total")
        desc = "returns the sum of a list of numbers"
        code = f"def {name}({var}):\n    result = 0\n    for x in {var}:\n        result += x\n    return result"
        note = f"It starts at 0 and adds each number. For example, {name}([1, 2, 3]) returns 6."
    elif kind == 1:
        name = _fn_name(rng, "largest")
        desc = "finds the largest number in a list"
        code = (f"def {name}({var}):\n    best = {var}[0]\n    for x in {var}[1:]:\n        if x > best:\n"
                f"            best = x\n    return best")
        note = f"It keeps the largest value seen so far. {name}([4, 9, 2]) returns 9."
    elif kind == 2:
        name = _fn_name(rng, "reverse")
        desc = "reverses a string"
        code = f"def {name}(text):\n    return text[::-1]"
        note = f"The slice [::-1] walks the string backwards, so {name}(\"abc\") returns \"cba\"."
    elif kind == 3:
        name = _fn_name(rng, "is_even")
        desc = "checks whether a number is even"
        code = f"def {name}(n):\n    return n % 2 == 0"
        note = f"A number is even when the remainder after dividing by 2 is 0. {name}(4) is True."
    elif kind == 4:
        name = _fn_name(rng, "count_vowels")
        desc = "counts the vowels in a string"
        code = (f"def {name}(text):\n    count = 0\n    for ch in text.lower():\n        if ch in \"aeiou\":\n"
                f"            count += 1\n    return count")
        note = f"It lowers the text and counts each vowel. {name}(\"Banana\") returns 3."
    elif kind == 5:
        name = _fn_name(rng, "factorial")
        desc = "computes the factorial of n"
        code = f"def {name}(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result"
        note = f"It multiplies 2, 3, ..., n together. {name}(5) returns 120."
    elif kind == 6:
        k = rng.randint(2, 10)
        name = _fn_name(rng, "multiples")
        desc = f"returns the first n multiples of {k}"
        code = f"def {name}(n):\n    return [{k} * i for i in range(1, n + 1)]"
        note = (f"The list comprehension builds {k}, {2 * k}, {3 * k} and so on. "
                f"{name}(3) returns [{k}, {2 * k}, {3 * k}].")
    elif kind == 7:
        name = _fn_name(rng, "average")
        desc = "returns the average of a list"
        code = f"def {name}({var}):\n    if not {var}:\n        return 0.0\n    return sum({var}) / len({var})"
        note = f"It returns 0.0 for an empty list, otherwise the sum divided by the length. {name}([2, 4]) is 3.0."
    elif kind == 8:
        name = _fn_name(rng, "word_count")
        desc = "counts how often each word appears in a text"
        code = (f"def {name}(text):\n    counts = {{}}\n    for word in text.split():\n"
                f"        counts[word] = counts.get(word, 0) + 1\n    return counts")
        note = (f"It splits the text on spaces and keeps a dictionary of counts. "
                f"{name}(\"a b a\") returns {{'a': 2, 'b': 1}}.")
    else:
        name = _fn_name(rng, "is_palindrome")
        desc = "checks whether a word is a palindrome"
        code = f"def {name}(word):\n    word = word.lower()\n    return word == word[::-1]"
        note = f"A palindrome reads the same backwards. {name}(\"Level\") returns True."
    q = _pick(rng, [f"Write a Python function {name} that {desc}.", f"Implement {name} in Python: it {desc}.",
                    f"Can you write a Python function called {name} that {desc}?"])
    intro = _pick(rng, ["Here is a simple solution:", "Here is one way to do it:", "Sure. Here is the function:"])
    return q, f"{intro}\n```python\n{code}\n```\n{note}"


def fact(rng: random.Random) -> tuple[str, str]:
    return FACTS[rng.randrange(len(FACTS))]


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
        if q in seen:
            continue
        seen.add(q)
        out.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return out


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write rows as JSON lines."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
