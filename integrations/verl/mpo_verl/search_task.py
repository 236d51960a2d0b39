"""The multi-hop search task of example_search_mpo.yaml, for verl's tool agent loop.

The repository's search environment (search_env.py: a fictional knowledge base, 2-4-hop
questions, BM25 retrieval) wired into verl by the example config:

    reward.custom_reward_function.path=pkg://mpo_verl.search_task  (name: compute_score)
    actor_rollout_ref.rollout.multi_turn.function_tool_path=${mpo_verl.file:search_tool.py}
    python -m mpo_verl.search_task --out /data/mpo_search        # train.parquet, val.parquet

The tool is in its own file because verl executes a function_tool_path file and registers its
tools by name; loading the reward from the same file in the same process would register the
tool twice, which verl refuses.

Unlike search_env's own Search-R1 text protocol (<search>q</search>), searches here are tool
calls in verl's multi-turn format (hermes), so verl's agent loop builds the turns and the
response_mask (1 = model tokens, 0 = tool responses) that MPO reads its turns from. The answer
protocol is the same: the final assistant turn ends with <answer>name</answer>.
"""
from __future__ import annotations

import argparse
import re
import threading
from pathlib import Path

from mpo_verl import load_repo_module

search_env = load_repo_module("search_env")     # the repository's search_env.py

SEED = 0
N_TRAIN, N_VAL = 5000, 500
# A larger KB than search_env's default so 5000 distinct training questions exist (432 documents
# per split). The tool, the data and the reward must use the same numbers: keep them here.
KB_SIZES = dict(n_people=300, n_organisations=60, n_cities=60, n_regions=12)
DATA_SOURCE = "mpo_search"

SYSTEM_PROMPT = (
    "Answer the question by searching a knowledge base with the `search` tool. Search for one name "
    "at a time: each document tells you the name to search for next. When you know the answer, reply "
    "with <answer>name</answer> (just the name, no explanation) and no tool call.")

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_retriever: search_env.BM25Search | None = None
_retriever_lock = threading.Lock()   # verl runs sync tools in threads (asyncio.to_thread)


def splits() -> tuple[search_env.Split, search_env.Split]:
    """The train and validation splits (deterministic in SEED and KB_SIZES)."""
    return search_env.make_dataset(n_train=N_TRAIN, n_val=N_VAL, seed=SEED, **KB_SIZES)


def search_documents(query: str) -> str:
    """The observation for a search: the top-3 BM25 documents of both splits' KBs."""
    global _retriever
    with _retriever_lock:    # built once per process; the two KBs share no name, so one index serves both
        if _retriever is None:
            train, val = splits()
            _retriever = search_env.BM25Search(train.docs + val.docs, k=3)
    return search_env.format_information(_retriever.search(query))


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's reward signature: 1.0 if the last <answer> in the response matches, else 0.0.

    `solution_str` is the decoded response, tool responses included; exact match after SQuAD
    normalisation (search_env.exact_match), 0 when there is no answer at all.
    """
    answers = _ANSWER.findall(solution_str)
    return search_env.exact_match(answers[-1], ground_truth) if answers else 0.0


def rows(split: search_env.Split) -> list[dict]:
    """One verl RLHFDataset row per question: chat prompt, ground truth, metadata."""
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                   {"role": "user", "content": search_env.user_message(q)}],
        "ability": "multi-hop-search",
        "reward_model": {"style": "rule", "ground_truth": q.answer},
        "extra_info": {"split": split.name, "index": i, "id": q.id, "hops": q.hops},
    } for i, q in enumerate(split.questions)]


def write_parquet(out_dir: str | Path) -> list[Path]:
    """Write train.parquet and val.parquet under out_dir; returns their paths."""
    import pandas as pd  # verl's dependency

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split in splits():
        path = out / f"{split.name}.parquet"
        pd.DataFrame(rows(split)).to_parquet(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (an absolute path is what verl needs)")
    for p in write_parquet(parser.parse_args().out):
        print(p)
