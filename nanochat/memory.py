"""
Memory a CPU run needs, estimated before it starts: a CPU that runs out of memory kills the process without
a word, so the scripts refuse a micro-batch that cannot fit, with a size that does.
"""

import os


def available_memory():
    """Bytes of memory this process can still use (Linux: MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def estimate_memory(num_params, n_layer, n_embd, vocab_size, tokens, training=True):
    """Bytes a CPU process needs, roughly (measured on CPU, depth 4-8, fp32), plus 1 GiB for the rest.
    Training: 16 per parameter (weights, gradients, two optimizer states) and, per token of a micro-batch,
    18 x vocab (the logits and their gradient) + 96 x layers x width (activations kept for the backward).
    Evaluation: 4 per parameter and, per token, 14 x vocab + 16 x layers x width."""
    if training:
        return 16 * num_params + tokens * (18 * vocab_size + 96 * n_layer * n_embd) + 2**30
    return 4 * num_params + tokens * (14 * vocab_size + 16 * n_layer * n_embd) + 2**30


def cpu_memory_error(num_params, config, batch_size, seq_len, training=True):
    """None when `batch_size` sequences of `seq_len` tokens fit in the memory available to the processes of
    this machine (or it is unknown); else the message, with a batch size that fits."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    have = available_memory()

    def need(b):
        return processes * estimate_memory(num_params, config.n_layer, config.n_embd, config.vocab_size, b * seq_len, training)
    if have is None or need(batch_size) <= have:
        return None
    fits = [b for b in (2 ** i for i in range(12)) if b < batch_size and need(b) <= have]
    return (f"{'training' if training else 'evaluating'} on the CPU with micro-batches of {batch_size} x {seq_len} tokens "
            f"needs about {need(batch_size) / 2**30:.1f} GiB, and {have / 2**30:.1f} GiB is available: lower "
            f"--device-batch-size" + (f" (about {fits[-1]} fits)" if fits else "") +
            (" or --max-seq-len, or train a smaller --depth" if training else ""))
