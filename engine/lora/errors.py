"""The LoRA error type, without torch: the API front end imports it to answer a bad adapter
(`api/lora.py`) without loading the engine's modules."""


class LoraError(ValueError):
    """An adapter that cannot be served: the message names the adapter and the reason."""
