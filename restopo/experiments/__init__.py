"""Experiments over many runs: `restopo sweep` (a grid of specs x overrides x seeds, each run
through `restopo train`) and `restopo compare` (a table, intervals and plots across runs).

    grid.py    the grid: jobs, their names (from what differs), their commands
    runner.py  running jobs: local processes, or Slurm / submitit's local executor
    runs.py    reading finished (or interrupted) run folders
    stats.py   means, spreads, paired intervals, the power-law fit of loss against compute
    report.py  the table (markdown, CSV), its plain-words reading, and the plots
"""
