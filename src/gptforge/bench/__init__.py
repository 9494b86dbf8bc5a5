"""`gptforge benchmark`: the keep-the-best variant grid and its timing (`grid`), and the report,
tables, plots and metrics written from its results (`report`)."""
