"""The prompts of benchmarks/bench_spec.py: copy-heavy (code to repeat with one name changed,
passages to summarise; short, and at the length of real requests) and nothing-to-copy (chat)
workloads, and the copy-heavy ones' prompts by kind."""

from __future__ import annotations

CODE = [
    """def parse_config(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    config = {}
    for line in lines:
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
""",
    """class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count += 1
        return self.count

    def reset(self):
        self.count = 0
""",
    """def mean_and_spread(values):
    total = 0.0
    for value in values:
        total += value
    mean = total / len(values)
    spread = max(values) - min(values)
    return mean, spread
""",
]
RENAMES = [("config", "settings"), ("Counter", "Tally"), ("total", "running_sum")]
PASSAGES = [
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin "
    "encompasses seven million square kilometres, of which five and a half million square "
    "kilometres are covered by the rainforest. The region includes territory belonging to nine "
    "nations. The majority of the forest is contained within Brazil, with 60% of the rainforest, "
    "followed by Peru with 13%, and Colombia with 10%.",
    "The Great Wall of China is a series of fortifications built across the historical northern "
    "borders of ancient Chinese states to protect against nomadic groups from the Eurasian "
    "Steppe. Several walls were built from as early as the 7th century BC, and were later joined "
    "together and made bigger and stronger by the Qin dynasty.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
    "to make glucose and oxygen. It takes place mainly in the leaves, inside small structures "
    "called chloroplasts, which contain the green pigment chlorophyll that absorbs light.",
]
CHATS = [
    "Write a short story about a robot who learns to paint.",
    "What are some good habits for staying healthy? Explain why each one helps.",
    "Describe your ideal weekend in a few paragraphs.",
    "Why do people enjoy travelling to new places?",
]

# more open-ended chat, longer answers: a policy that decides when to draft is judged on more
# than CHATS' four (`bench_spec_modelled.py`'s "chat, more" workload)
CHATS_MORE = [
    "Explain how a refrigerator keeps food cold, step by step.",
    "Give me advice for my first week at a new job.",
    "Write a poem about the sea at night.",
    "What is the difference between weather and climate?",
    "Plan a three-day trip to Rome for someone who loves history.",
    "How do I start learning to play the guitar as an adult?",
    "Compare cats and dogs as pets for a small apartment.",
    "Tell me about the history of the bicycle.",
    "Write a friendly email inviting my neighbours to a garden party.",
    "What should I consider when choosing a laptop for university?",
    "Describe a busy market in a small town on a Saturday morning.",
    "Why is sleep important, and how can I sleep better?",
]

# copy-heavy at the length of real requests: a whole class or module to rename in, a passage
# of a page to summarise (the short prompts above give 14-70 token answers, where prefill is
# most of a request's time)
CODE_LONG = [
    '''class InventoryManager:
    """Keeps the stock level of every item in a small shop."""

    def __init__(self, items=None):
        self.items = dict(items or {})
        self.history = []

    def add(self, name, quantity):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self.items[name] = self.items.get(name, 0) + quantity
        self.history.append(("add", name, quantity))

    def remove(self, name, quantity):
        available = self.items.get(name, 0)
        if quantity > available:
            raise ValueError(f"only {available} of {name} left")
        self.items[name] = available - quantity
        if self.items[name] == 0:
            del self.items[name]
        self.history.append(("remove", name, quantity))

    def count(self, name):
        return self.items.get(name, 0)

    def low_stock(self, threshold=5):
        return sorted(name for name, quantity in self.items.items() if quantity < threshold)

    def report(self):
        lines = [f"{name}: {quantity}" for name, quantity in sorted(self.items.items())]
        return "\\n".join(lines)
''',
    """import re
from collections import Counter


def word_frequencies(text):
    words = re.findall(r"[a-z']+", text.lower())
    return Counter(words)


def top_words(text, count=10):
    frequencies = word_frequencies(text)
    return [word for word, _ in frequencies.most_common(count)]


def sentence_lengths(text):
    sentences = [s.strip() for s in re.split(r"[.!?]+", text) if s.strip()]
    return [len(sentence.split()) for sentence in sentences]


def average_sentence_length(text):
    lengths = sentence_lengths(text)
    if not lengths:
        return 0.0
    return sum(lengths) / len(lengths)


def summary(text):
    frequencies = word_frequencies(text)
    return {
        "words": sum(frequencies.values()),
        "distinct_words": len(frequencies),
        "top_words": top_words(text, 5),
        "average_sentence_length": average_sentence_length(text),
    }
""",
    """from collections import OrderedDict


class LRUCache:
    def __init__(self, capacity):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.entries = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        if key not in self.entries:
            self.misses += 1
            return default
        self.hits += 1
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key, value):
        if key in self.entries:
            self.entries.move_to_end(key)
        self.entries[key] = value
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def hit_rate(self):
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def clear(self):
        self.entries.clear()
        self.hits = 0
        self.misses = 0
""",
]
RENAMES_LONG = [
    ("InventoryManager", "StockKeeper"),
    ("word_frequencies", "count_words"),
    ("capacity", "max_entries"),
]
PASSAGES_LONG = [
    "The printing press was developed in the German city of Mainz around 1440 by Johannes "
    "Gutenberg. Before it, books in Europe were copied by hand, usually by monks, and a single "
    "book could take months to finish. Gutenberg combined several existing ideas: movable "
    "metal type, an oil-based ink that stuck to metal, and a screw press adapted from the "
    "presses used to make wine. With these, a small workshop could print hundreds of pages a "
    "day. The first major book printed this way was the Gutenberg Bible, of which about 180 "
    "copies were made. Printing spread quickly: by 1500, presses were working in more than "
    "two hundred European cities, and they had produced millions of books. Cheaper books meant "
    "that more people learned to read, and ideas travelled faster than ever before. Historians "
    "link the printing press to the spread of the Renaissance, the Reformation and, later, the "
    "Scientific Revolution, because scholars could share and check each other's work.",
    "The water cycle describes how water moves between the oceans, the air and the land. Heat "
    "from the sun evaporates water from oceans, lakes and rivers, and plants release water "
    "vapour from their leaves in a process called transpiration. As the warm, moist air rises, "
    "it cools, and the vapour condenses into tiny droplets that form clouds. When the droplets "
    "join together and become heavy enough, they fall as precipitation: rain, snow, sleet or "
    "hail. Some of this water flows over the ground into streams and rivers and back to the "
    "sea. Some soaks into the soil and becomes groundwater, which can stay underground for "
    "thousands of years before it reaches a spring or a well. Snow and ice can store water for "
    "a long time too, in glaciers and ice caps. The water cycle moves heat around the planet, "
    "shapes the weather, and supplies the fresh water that people, animals and plants need.",
    "The Romans built one of the largest road networks of the ancient world. At its height it "
    "included more than 80,000 kilometres of paved roads, linking Rome to the provinces from "
    "Britain to Syria. The roads were built mainly for the army, so that soldiers and supplies "
    "could move quickly, but merchants, messengers and travellers used them as well. A typical "
    "road was built in layers: a foundation of large stones, then smaller stones and gravel, "
    "and finally a surface of tightly fitted paving stones, slightly curved so that rain would "
    "run off to the sides. Milestones along the way told travellers the distance to the next "
    "town. Inns and stables were placed at regular intervals, where official messengers could "
    "change horses. Many Roman roads were so well built that they remained in use for "
    "centuries, and several modern European roads still follow their routes.",
]


def _summarise(passage: str) -> str:
    return f"Summarize the following passage in a few sentences, reusing its wording:\n\n{passage}"


def _kinds(code: list[str], summaries: list[str]) -> dict[str, range]:
    """The prompts of a copy-heavy workload by kind (the code first, then the summaries)."""
    return {
        f"code ({len(code)})": range(len(code)),
        f"summaries ({len(summaries)})": range(len(code), len(code) + len(summaries)),
    }


def workloads(
    quick: bool, max_tokens: int, long_max_tokens: int
) -> dict[str, tuple[list[list[dict]], int]]:
    """name -> (chats, max tokens). copy-heavy: the code in a fenced block, as a user pastes
    code into a chat (the model then copies it); the earlier unfenced prompts, which the model
    mostly rewrites, stay as their own workload so the runs compare across sessions.
    "copy-heavy, long": the same two tasks at the length of real requests (max tokens enough
    for the whole answer)."""
    code = [
        f"Rename `{old}` to `{new}` in this code and show the full updated code:\n\n"
        f"```python\n{text}```"
        for text, (old, new) in zip(CODE, RENAMES, strict=True)
    ]
    unfenced = [
        f"Repeat the following code exactly, but rename {old} to {new}. Output only "
        f"the code, no explanation.\n\n{text}"
        for text, (old, new) in zip(CODE, RENAMES, strict=True)
    ]
    summaries = [_summarise(passage) for passage in PASSAGES]
    code_long = [
        f"Here is my code:\n\n```python\n{text}```\n\nPlease rename `{old}` to "
        f"`{new}` and give me the complete code."
        for text, (old, new) in zip(CODE_LONG, RENAMES_LONG, strict=True)
    ]
    summaries_long = [_summarise(passage) for passage in PASSAGES_LONG]
    sets = {
        "copy-heavy": (code + summaries, max_tokens),
        "copy-heavy, unfenced code": (unfenced + summaries, max_tokens),
        "copy-heavy, long": (code_long + summaries_long, long_max_tokens),
        "nothing-to-copy": (list(CHATS), max_tokens),
    }
    if quick:
        sets = {
            "copy-heavy": (code[:1] + summaries[:1], max_tokens),
            "nothing-to-copy": (CHATS[:1], max_tokens),
        }
    return {
        name: ([[{"role": "user", "content": t}] for t in texts], tokens)
        for name, (texts, tokens) in sets.items()
    }


# the copy-heavy workloads' prompts by kind, for the per-kind table
PARTS = {
    "copy-heavy": _kinds(CODE, PASSAGES),
    "copy-heavy, unfenced code": _kinds(CODE, PASSAGES),
    "copy-heavy, long": _kinds(CODE_LONG, PASSAGES_LONG),
}
