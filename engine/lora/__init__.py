"""Multi-LoRA serving: adapters read from PEFT directories (`adapter`), a fixed device pool of
slots with the per-step SGMV-style delta (`slots`), and the registry / host LRU / slot
assignment (`manager`). The scheduler keeps the running requests' distinct adapters within
`max_loras`; the model runner tells the manager each step which rows use which adapter."""
