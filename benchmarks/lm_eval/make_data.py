"""Writes the committed data of the lm-eval tasks in benchmarks/lm_eval/tasks (run it again to
check the files are what this script makes: it is deterministic).

One fact per row, a country and its capital (60 rows, capitals without accents or commas so
exact match needs no normalisation beyond case and spaces). The multiple-choice task offers the
capital among three other rows' capitals, in a position fixed by a seeded generator.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("the United Kingdom", "London"), ("Ireland", "Dublin"),
    ("the Netherlands", "Amsterdam"), ("Belgium", "Brussels"), ("Switzerland", "Bern"),
    ("Austria", "Vienna"), ("Poland", "Warsaw"), ("the Czech Republic", "Prague"),
    ("Hungary", "Budapest"), ("Greece", "Athens"), ("Sweden", "Stockholm"), ("Norway", "Oslo"),
    ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Iceland", "Reykjavik"),
    ("Russia", "Moscow"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Turkey", "Ankara"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Nigeria", "Abuja"), ("Ethiopia", "Addis Ababa"),
    ("Morocco", "Rabat"), ("Ghana", "Accra"), ("Senegal", "Dakar"), ("Algeria", "Algiers"),
    ("Tunisia", "Tunis"), ("Japan", "Tokyo"), ("China", "Beijing"), ("South Korea", "Seoul"),
    ("India", "New Delhi"), ("Pakistan", "Islamabad"), ("Bangladesh", "Dhaka"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"),
    ("the Philippines", "Manila"), ("Malaysia", "Kuala Lumpur"), ("Iran", "Tehran"),
    ("Iraq", "Baghdad"), ("Saudi Arabia", "Riyadh"), ("Syria", "Damascus"),
    ("Afghanistan", "Kabul"), ("Nepal", "Kathmandu"), ("Canada", "Ottawa"),
    ("Mexico", "Mexico City"), ("Cuba", "Havana"), ("Argentina", "Buenos Aires"),
    ("Chile", "Santiago"), ("Peru", "Lima"), ("Australia", "Canberra"),
]
DATA_DIR = Path(__file__).parent / "data"


def rows() -> list[dict]:
    rng = random.Random(0)
    capitals = [capital for _, capital in CAPITALS]
    out = []
    for country, capital in CAPITALS:
        choices = rng.sample([c for c in capitals if c != capital], 3)
        answer = rng.randrange(4)
        choices.insert(answer, capital)
        out.append({"country": country, "capital": capital, "choices": choices,
                    "answer": answer})
    return out


def main() -> None:
    assert len(CAPITALS) == 60 and len({c for _, c in CAPITALS}) == 60
    DATA_DIR.mkdir(exist_ok=True)
    lines = [json.dumps(row, ensure_ascii=True) for row in rows()]
    (DATA_DIR / "capitals.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
