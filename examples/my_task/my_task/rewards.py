"""A reward for the word-reversal task: full marks for the exact reversal, part marks for
each letter already in place."""

from typing import Any

from astra.rewards import Scored


def reversal(record: dict[str, Any], completion: str, **context: Any) -> float:
    """1.0 for the exact answer; else 0.5 * the share of the answer's letters in place.

    `record` is the dataset line (here `{"prompt": "reverse abc=", "answer": "cba"}`),
    `completion` the text the model wrote, `context` extra facts (prompt, group_id,
    sample_index, workflow, policy_id) a reward may ignore.
    """
    answer = str(record["answer"])
    said = completion.strip()
    if said == answer:
        return 1.0
    in_place = sum(a == b for a, b in zip(said, answer, strict=False))
    # A float with metadata: what the run's trajectories record about this score.
    return Scored(0.5 * in_place / len(answer), in_place=in_place, said=said[:32])
