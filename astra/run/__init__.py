"""`astra run`: the whole system from one recipe (supervisor, live view, metrics, summary)."""
