"""The words and surface variation of the demo's synthetic prompts: names, items, units, facts, greetings, numbers
as digits or words, politeness, casing and typos. `synth.py` builds the task templates on them."""

from __future__ import annotations

import random

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
    ("hey", "Hello! How can I help you today? I can work through arithmetic, convert units, solve word "
     "problems or write small Python functions."),
    ("Good morning!", "Good morning! How can I help you today? I can do arithmetic step by step, convert units "
     "and write small Python functions."),
    ("Thank you so much.", "You are welcome! Let me know if you have another question."),
    ("What are you good at?", "I can add, subtract, multiply and divide numbers step by step, solve short word "
     "problems, convert between units and write small Python functions."),
    ("Are you a big model?", "No. I am a tiny demo model with a few million parameters, trained on synthetic "
     "arithmetic, unit conversions and small Python functions."),
]


def pick(rng: random.Random, options: list[str]) -> str:
    return options[rng.randrange(len(options))]


_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """0 <= n < 100 in words: 48 -> "forty-eight"."""
    if n < 20:
        return _ONES[n]
    t, o = divmod(n, 10)
    return _TENS[t] + ("-" + _ONES[o] if o else "")


def num(rng: random.Random, n: int, words: float = 0.08) -> str:
    """A number as a user might type it: digits, sometimes words (below 100), thousands with a comma."""
    if 0 <= n < 100 and rng.random() < words:
        return number_words(n)
    if n >= 1000 and rng.random() < 0.5:
        return f"{n:,}"
    return str(n)


PREFIXES = ["Hi! ", "Hey, ", "Hello. ", "Quick question: ", "Question: ", "Help me with this: ", "Can you help? ",
            "I have a question. ", "ok so ", "Hi there, ", "Good morning! ", "Homework: "]
SUFFIXES = [" Thanks!", " Thank you.", " Please show the steps.", " please", " thx", " Thanks in advance.",
            " I'm stuck.", " Explain briefly."]


def typo(rng: random.Random, text: str) -> str:
    """One keyboard slip in a word of 4+ letters: swapped, dropped or doubled letter."""
    words = text.split(" ")
    idx = [i for i, w in enumerate(words) if len(w) >= 4 and w.isalpha()]
    if not idx:
        return text
    i = idx[rng.randrange(len(idx))]
    w = words[i]
    j = rng.randrange(1, len(w) - 1)
    kind = rng.randrange(3)
    if kind == 0:
        w = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    elif kind == 1:
        w = w[:j] + w[j + 1:]
    else:
        w = w[:j] + w[j] + w[j:]
    words[i] = w
    return " ".join(words)


def surface(rng: random.Random, q: str) -> str:
    """Surface variation of a prompt: greetings, thanks, casing, missing punctuation, a typo."""
    if rng.random() < 0.08:
        q = typo(rng, q)
    if rng.random() < 0.15 and q[-1] in ".?":
        q = q[:-1]
    if rng.random() < 0.14:
        q = pick(rng, PREFIXES) + q
    if rng.random() < 0.12:
        q = q + pick(rng, SUFFIXES)
    r = rng.random()
    if r < 0.12:
        q = q.lower()
    elif r < 0.14:
        q = q.upper()
    return q
