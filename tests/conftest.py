import os

# Nothing may be fetched from a model hub in tests: checkpoints are built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
