"""The chat demo's conversations, made on the machine from a seed: a task whose answers can be checked and
that needs what the conversation says, so that a fine-tuned model's exact-match accuracy proves it learned.

"recall": the user says who they are and where they live (names and places from Shakespeare's plays), in one
of a few phrasings, then asks one of the two back; the assistant answers from what the user said ("You live in
Verona."). Sometimes the facts and the question are two turns, with the assistant's greeting between them. No
(name, place) pair is used twice, so a held-out conversation's pair is one training never saw: only reading it
from the conversation answers it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from gpt2train.files import write_text_atomic

DEMOS = ("recall",)
DEFAULT_CONVERSATIONS = 5000

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


def most_conversations(demo: str = "recall") -> int:
    check_demo(demo)
    return len(NAMES) * len(PLACES)


def check_demo(demo: str) -> None:
    if demo not in DEMOS:
        raise ValueError(f"unknown demo {demo!r}; choose {', '.join(DEMOS)}")


def demo_conversations(demo: str, n: int, seed: int = 0) -> list[dict]:
    """n conversations of the demo as {"messages": [...]} rows (OpenAI's fine-tuning format), the same for the same
    seed; no two share their (name, place) pair."""
    most = most_conversations(demo)
    if not 0 < n <= most:
        raise ValueError(f"the {demo} demo makes 1 to {most:,} conversations (one per name and place), not {n:,}")
    rng = random.Random(seed)
    rows = []
    for pair in rng.sample(range(most), n):
        name, place = NAMES[pair // len(PLACES)], PLACES[pair % len(PLACES)]
        facts = rng.choice(FACTS).format(name=name, place=place)
        asked = rng.choice(("name", "place"))
        question = rng.choice(QUESTIONS[asked])
        answer = ANSWERS[asked].format(name=name, place=place)
        if rng.random() < 0.5:
            messages = [{"role": "user", "content": f"{facts} {question}"}]
        else:
            messages = [{"role": "user", "content": facts},
                        {"role": "assistant", "content": GREETING.format(name=name)},
                        {"role": "user", "content": question}]
        rows.append({"messages": [*messages, {"role": "assistant", "content": answer}]})
    return rows


def write_demo(demo: str, out_dir: str | Path, n: int, seed: int = 0) -> Path:
    """OUT/DEMO.jsonl: the demo's conversations as `prepare chat` reads them (and a person can)."""
    rows = demo_conversations(demo, n, seed)
    path = Path(out_dir) / f"{demo}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
