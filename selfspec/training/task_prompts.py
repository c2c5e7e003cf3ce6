"""Task prompts for self-distillation without a dataset: request templates of the kinds chat assistants are asked
for (writing, role-play, reasoning, math, coding, extraction, science, humanities, advice), filled with subjects,
deterministically from a seed.

Prompts the model writes for itself (``prompts: self``) come out as statements about news and facts; answers to
them teach draft heads little about how the model answers real requests (on MT-bench-style questions the heads'
top-1 halves). These templates give the model requests to answer; the answers are still entirely its own.
"""

from __future__ import annotations

import random

# {s}: a subject from SUBJECTS; {c}: a coding task from CODE_TASKS; {n}: a small number; {p}: a person; {w}: a word.
TEMPLATES = [
    # writing
    "Write a short story about {s}.", "Write a poem about {s}.", "Write a persuasive essay arguing for {s}.",
    "Write a blog post about {s} for beginners.", "Write a product description for something related to {s}.",
    "Draft a professional email to {p} about {s}.", "Write a speech for a school assembly about {s}.",
    "Write a dialogue between two friends discussing {s}.", "Write a limerick about {s}.",
    "Rewrite this sentence to be more formal: 'we gotta talk about {s} asap'.",
    "Write a haiku about {s}.", "Write the opening paragraph of a mystery novel involving {s}.",
    # role-play
    "Pretend you are {p}. Explain your view on {s}.", "Act as a tour guide and describe {s}.",
    "You are a job interviewer. Ask me three questions about {s}.", "Imagine you are a teacher explaining {s} to a class.",
    "Role-play as a customer service agent helping someone with a problem about {s}.",
    # reasoning
    "What are the pros and cons of {s}?", "Compare {s} with its alternatives.", "Why do people disagree about {s}?",
    "What would happen if {s} disappeared tomorrow?", "Give three arguments for and three against {s}.",
    "If I have {n} apples and give away half, then buy {n} more, how many do I have? Explain step by step.",
    "A train travels {n}0 kilometres in {n} hours. What is its average speed? Show your reasoning.",
    # math
    "Solve for x: {n}x + 7 = {n}5. Explain each step.", "What is the sum of the first {n}0 positive integers?",
    "Explain how to find the area of a circle with radius {n}.", "What is {n}5% of 480? Show the calculation.",
    "Explain the Pythagorean theorem with an example.", "Find the derivative of x^{n} + 3x and explain the rule used.",
    "What is the probability of rolling a sum of {n} with two dice?",
    # coding
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.",
    "Explain how to {c} in Python, with code.", "Write a C++ program that {c}.",
    "What is the time complexity of a function that {c}? Explain.", "Write a SQL query for a table of {s} that counts rows per category.",
    "Find the bug: def add(a, b): return a - b. Explain the fix.",
    # extraction
    "Extract the key points from this text: '{s} has changed a lot in recent years, and experts expect more change.'",
    "Summarize in one sentence: {s} is a topic that many people find interesting for different reasons.",
    "List the main ideas someone should know about {s}.", "Turn this into a bulleted list: {s}, its history, its uses, its future.",
    # science / stem
    "Explain {s} in simple terms.", "How does {s} work?", "What is the science behind {s}?",
    "Describe the history of {s}.", "What are common misconceptions about {s}?",
    "Explain the difference between {s} and a related idea.",
    # humanities
    "How has {s} influenced culture?", "Discuss the ethical questions raised by {s}.",
    "What can history teach us about {s}?", "How do different countries approach {s}?",
    # advice
    "Give me {n} tips about {s}.", "How can I get better at {s}?", "Make a one-week plan for learning about {s}.",
    "What should a beginner know about {s}?", "Recommend some books or resources about {s}.",
    "Help me plan a trip focused on {s}.", "What questions should I ask an expert on {s}?",
]

SUBJECTS = [
    "climate change", "renewable energy", "the history of the internet", "black holes", "photosynthesis",
    "machine learning", "healthy eating", "remote work", "urban gardening", "electric cars", "the Roman Empire",
    "the French Revolution", "volcanoes", "the human immune system", "social media", "space exploration",
    "public libraries", "video games", "classical music", "jazz", "the ocean", "honey bees", "friendship",
    "time management", "personal finance", "saving for retirement", "learning a new language", "chess",
    "basketball", "marathon running", "meditation", "sleep", "coffee", "chocolate", "bread baking",
    "a small town festival", "a lost key", "a robot who wants to paint", "a lighthouse keeper", "a haunted library",
    "dinosaurs", "the moon landing", "artificial intelligence", "privacy online", "democracy", "recycling",
    "the water cycle", "earthquakes", "vaccines", "antibiotics", "quantum computing", "the stock market",
    "inflation", "cryptocurrency", "the printing press", "Shakespeare", "ancient Egypt", "the Silk Road",
    "impressionist painting", "photography", "film making", "public speaking", "job interviews", "leadership",
    "teamwork", "parenting", "pets", "dogs", "cats", "birdwatching", "hiking", "camping", "travel in Japan",
    "the Amazon rainforest", "deserts", "glaciers", "electricity", "magnets", "the periodic table", "DNA",
    "evolution", "the solar system", "weather forecasting", "architecture", "bridges", "trains", "airplanes",
    "3D printing", "smartphones", "cybersecurity", "open source software", "online education", "board games",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "sorts a list of numbers without using the built-in sort", "counts the words in a text",
    "finds the largest element of a list", "removes duplicates from a list while keeping order",
    "checks whether a string is a palindrome", "merges two sorted lists", "computes the factorial of a number",
    "converts Celsius to Fahrenheit", "reads a CSV file and prints the average of a column",
    "finds the most common character in a string", "implements binary search", "flattens a nested list",
    "validates an email address with a regular expression", "computes the greatest common divisor of two numbers",
    "returns the intersection of two lists", "counts the vowels in a string", "transposes a matrix",
]

PEOPLE = ["a teacher", "my manager", "a scientist", "a pirate", "a famous chef", "a detective", "a doctor",
          "a historian", "an astronaut", "a new neighbour", "a customer", "a city council member"]


def task_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` distinct filled templates, in a seeded random order (the same list for the same seed).

    Raises:
        ValueError: ``num_prompts`` below 1, or more than the templates can fill distinctly.
    """
    if num_prompts < 1:
        raise ValueError(f"task prompts: num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < num_prompts:
        attempts += 1
        if attempts > 50 * num_prompts + 1000:
            raise ValueError(f"task prompts: could not fill {num_prompts} distinct prompts (got {len(out)})")
        text = rng.choice(TEMPLATES).format(s=rng.choice(SUBJECTS), c=rng.choice(CODE_TASKS), n=rng.randint(2, 9),
                                            p=rng.choice(PEOPLE))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
