"""The SmolLM2 study's one-question tools: each answered one question of the finished study and is
kept runnable as its record. Their results and design notes live in
experiments/results/smol_hops_critic_offline/, smol_hops_turn/ (and smol_hops_replay/ for the
replays); the study's driver stays experiments/smol_study.py (docs/smol.md, docs/records/smol.md).

    python experiments/records/smol/critic_offline.py collect   # then fit | probe | head | transfer | report
    python experiments/records/smol/replay_steps.py RUN_DIR --from_step 22 --to_step 24 --out FILE.json
    python experiments/records/smol/final_critics.py experiments/results/smol_hops_turn/final_critics/s*.pt
"""
