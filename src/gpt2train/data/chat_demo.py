"""The chat demo's conversations, made on the machine from a seed: tasks whose answers can be checked and that
need what the conversation says, so that a fine-tuned model's exact-match accuracy proves it learned.

"recall": the user says who they are and where they live (names and places from Shakespeare's plays), in one
of a few phrasings, then asks one of the two back; the assistant answers from what the user said ("You live in
Verona."). Sometimes the facts and the question are two turns, with the assistant's greeting between them. No
(name, place) pair is used twice, so a held-out conversation's pair is one training never saw: only reading it
from the conversation answers it.

"pick": the user gives a list of three to five things and asks for one by its place (the second, the last) or
by the one before it ("What comes after the lamp?"); the assistant names it. No list is used twice.

"count": the user says how many of two to four kinds of things they have ("3 cats, 12 hens and 7 goats"), then
asks for one kind's number; the assistant says it. No statement (kinds and numbers) is used twice, and the
numbers of one conversation differ, so the answer is the asked kind's own.

Each asks one question, and in half the conversations the question is a second turn after a short reply.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from gpt2train.files import write_text_atomic

DEMOS = ("recall", "pick", "count")
# How many --demo makes by default: recall all but a few of its 5,518 pairs; pick and count enough that chat-cpu's
# rows see each about three times (with 5,000 the model learned part of them by heart: docs/chat.md)
DEFAULT_CONVERSATIONS = {"recall": 5000, "pick": 20000, "count": 20000}

NAMES = (
    "Romeo", "Juliet", "Hamlet", "Ophelia", "Portia", "Viola", "Orlando", "Rosalind", "Beatrice", "Benedick",
    "Miranda", "Prospero", "Othello", "Desdemona", "Iago", "Cordelia", "Lear", "Macbeth", "Banquo", "Duncan",
    "Horatio", "Laertes", "Polonius", "Gertrude", "Claudio", "Hero", "Helena", "Hermia", "Lysander", "Demetrius",
    "Puck", "Oberon", "Titania", "Bottom", "Antonio", "Bassanio", "Shylock", "Jessica", "Lorenzo", "Sebastian",
    "Olivia", "Malvolio", "Cassio", "Emilia", "Bianca", "Petruchio", "Katherina", "Lucentio", "Tybalt", "Mercutio",
    "Benvolio", "Paris", "Falstaff", "Imogen", "Perdita", "Florizel", "Leontes", "Hermione", "Paulina", "Cressida",
    "Troilus", "Hector", "Achilles", "Cleopatra", "Antony", "Octavia", "Brutus", "Cassius", "Caesar", "Calpurnia",
    "Coriolanus", "Volumnia", "Timon", "Pericles", "Marina", "Lavinia", "Titus", "Tamora", "Aaron", "Rosaline",
    "Nerissa", "Gratiano", "Ariel", "Caliban", "Ferdinand", "Gonzalo", "Isabella", "Angelo", "Mariana",
)
PLACES = (
    "Verona", "Padua", "Mantua", "Venice", "Milan", "Athens", "Rome", "Vienna", "Naples", "Messina", "Elsinore",
    "Illyria", "Windsor", "London", "York", "Kent", "Dover", "Bohemia", "Sicilia", "Tyre", "Ephesus", "Troy",
    "Egypt", "Alexandria", "Cyprus", "Scotland", "Denmark", "Norway", "France", "Navarre", "Florence", "Pisa",
    "Genoa", "Arden", "Belmont", "Inverness", "Glamis", "Cawdor", "Antioch", "Sardis", "Philippi", "Actium",
    "Corioles", "Tarsus", "Mytilene", "Pentapolis", "Bordeaux", "Orleans", "Calais", "Harfleur", "Agincourt",
    "Bristol", "Coventry", "Oxford", "Cambridge", "Warwick", "Gloucester", "Lancaster", "Exeter", "Winchester",
    "Canterbury", "Salisbury",
)
FACTS = (
    "My name is {name} and I live in {place}.",
    "I am {name}, and my home is {place}.",
    "I live in {place}. My name is {name}.",
    "Hello! I'm {name} from {place}.",
)
QUESTIONS = {
    "name": ("What is my name?", "Who am I?", "Do you remember my name?"),
    "place": ("Where do I live?", "What city am I from?", "Where is my home?"),
}
ANSWERS = {"name": "Your name is {name}.", "place": "You live in {place}."}  # one per kind: the reply is checkable
GREETING = "Nice to meet you, {name}."

# pick: things (some more than one GPT-2 token, as most words are), lists of 3 to 5 of them
THINGS = (
    "apple", "pear", "plum", "lemon", "grape", "peach", "cherry", "melon", "onion", "carrot", "lamp", "chair",
    "table", "clock", "spoon", "knife", "bottle", "basket", "candle", "mirror", "pillow", "blanket", "ribbon",
    "button", "needle", "hammer", "ladder", "bucket", "rope", "drum", "flute", "harp", "bell", "coin", "ring",
    "crown", "sword", "shield", "boot", "glove", "hat", "cloak", "scarf", "book", "letter", "map", "kettle", "bowl",
)
LISTS = ("Here is my list: {items}.", "I packed {items}.", "In the box there are {items}.",
         "My shopping list: {items}.")
ORDINALS = ("first", "second", "third", "fourth", "fifth")
PICK_QUESTIONS = {
    "place": ("What is the {ordinal} one?", "Which is the {ordinal} item?", "Name the {ordinal} thing."),
    "last": ("What is the last one?", "Which comes last?", "Name the last thing."),
    "after": ("What comes after the {before}?", "Which one follows the {before}?", "What is next after the {before}?"),
}
PICK_ANSWERS = {"place": "The {ordinal} one is the {item}.", "last": "The last one is the {item}.",
                "after": "After the {before} comes the {item}."}
PICK_REPLY = "Got it, {n} things."

# count: kinds of things and how many of each, 2 to 4 kinds with different numbers from 2 to 99
KINDS = (
    "cats", "dogs", "hens", "goats", "sheep", "cows", "horses", "pigs", "ducks", "geese", "apples", "pears", "plums",
    "lemons", "eggs", "books", "coins", "rings", "candles", "lamps", "chairs", "cups", "bowls", "spoons", "boats",
    "keys", "bells", "drums",
)
STATEMENTS = ("I have {counts}.", "On my farm there are {counts}.", "I counted {counts}.", "In my house: {counts}.")
COUNT_QUESTIONS = ("How many {kind} do I have?", "How many {kind} are there?", "What is the number of {kind}?")
COUNT_ANSWER = "There are {number} {kind}."
COUNT_REPLY = "Noted."
MOST_MADE = 100_000  # pick and count: far fewer than their distinct lists and statements, so none repeats


def most_conversations(demo: str = "recall") -> int:
    check_demo(demo)
    return len(NAMES) * len(PLACES) if demo == "recall" else MOST_MADE


def check_demo(demo: str) -> None:
    if demo not in DEMOS:
        raise ValueError(f"unknown demo {demo!r}; choose {', '.join(DEMOS)}")


def demo_conversations(demo: str, n: int, seed: int = 0) -> list[dict]:
    """n conversations of the demo as {"messages": [...]} rows (OpenAI's fine-tuning format), the same for the same
    seed; no two share what the user states (recall: the (name, place) pair; pick: the list; count: the kinds and
    numbers)."""
    most = most_conversations(demo)
    if not 0 < n <= most:
        what = "one per name and place" if demo == "recall" else "none stated twice"
        raise ValueError(f"the {demo} demo makes 1 to {most:,} conversations ({what}), not {n:,}")
    rng = random.Random(seed)
    make = {"recall": recall_conversations, "pick": pick_conversations, "count": count_conversations}[demo]
    return [{"messages": messages} for messages in make(n, rng)]


def recall_conversations(n: int, rng: random.Random) -> list[list[dict]]:
    rows = []
    for pair in rng.sample(range(len(NAMES) * len(PLACES)), n):
        name, place = NAMES[pair // len(PLACES)], PLACES[pair % len(PLACES)]
        facts = rng.choice(FACTS).format(name=name, place=place)
        asked = rng.choice(("name", "place"))
        question = rng.choice(QUESTIONS[asked])
        answer = ANSWERS[asked].format(name=name, place=place)
        rows.append(conversation(rng, facts, GREETING.format(name=name), question, answer))
    return rows


def pick_conversations(n: int, rng: random.Random) -> list[list[dict]]:
    rows = []
    for items in distinct(n, lambda: tuple(rng.sample(THINGS, rng.randint(3, 5)))):
        asked = rng.choice(tuple(PICK_QUESTIONS))
        at = {"place": rng.randrange(len(items)), "last": len(items) - 1, "after": rng.randrange(1, len(items))}[asked]
        fields = dict(ordinal=ORDINALS[at], item=items[at], before=items[at - 1])
        statement = rng.choice(LISTS).format(items=spoken_list(items))
        question = rng.choice(PICK_QUESTIONS[asked]).format(**fields)
        rows.append(conversation(rng, statement, PICK_REPLY.format(n=len(items)), question,
                                 PICK_ANSWERS[asked].format(**fields)))
    return rows


def count_conversations(n: int, rng: random.Random) -> list[list[dict]]:
    def draw():
        k = rng.randint(2, 4)
        return tuple(zip(rng.sample(KINDS, k), rng.sample(range(2, 100), k)))

    rows = []
    for counts in distinct(n, draw):
        kind, number = rng.choice(counts)
        statement = rng.choice(STATEMENTS).format(counts=spoken_list([f"{k} {name}" for name, k in counts]))
        question = rng.choice(COUNT_QUESTIONS).format(kind=kind)
        rows.append(conversation(rng, statement, COUNT_REPLY, question,
                                 COUNT_ANSWER.format(number=number, kind=kind)))
    return rows


def distinct(n: int, draw) -> list:
    """n different draws, in the order drawn (a repeat is drawn again)."""
    seen: dict = {}
    while len(seen) < n:
        seen.setdefault(draw(), None)
    return list(seen)


def spoken_list(items) -> str:
    """"a, b and c"."""
    return ", ".join(items[:-1]) + " and " + items[-1]


def conversation(rng: random.Random, statement: str, reply: str, question: str, answer: str) -> list[dict]:
    """The statement and the question in one user turn, or (half the time) in two with the assistant's short reply
    between them; then the answer."""
    if rng.random() < 0.5:
        messages = [{"role": "user", "content": f"{statement} {question}"}]
    else:
        messages = [{"role": "user", "content": statement}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": question}]
    return [*messages, {"role": "assistant", "content": answer}]


def write_demo(demo: str, out_dir: str | Path, n: int, seed: int = 0) -> Path:
    """OUT/DEMO.jsonl: the demo's conversations as `prepare chat` reads them (and a person can)."""
    rows = demo_conversations(demo, n, seed)
    path = Path(out_dir) / f"{demo}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
