"""LoRA adapters: the version format (format.py), and the layers that train and serve them."""
