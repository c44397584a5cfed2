"""``sim``: the inputs the twin replays (our traces, the Azure CSV, Mooncake JSONL) and its results."""
