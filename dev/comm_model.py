"""
A model of the data-parallel communication of one optimizer step across nodes, before and after
overlapping the gradient reduction with the backward (optim.MuonAdamW, --overlap-grad-reduce).

    python -m dev.comm_model                      # d20 and d26, 1/2/8/64 nodes of 8 GPUs
    python -m dev.comm_model --ib-gbps 200 --mfu 0.45

What moves per step, per GPU, over a ring of n GPUs (bytes a GPU sends; time = bytes / bus bandwidth):
  Muon matrices       reduce-scatter of the fp32 gradients       (n-1)/n * 4 B * params
                      all-gather of the updates (bf16)            (n-1)/n * 2 B * params
  large AdamW tensors reduce-scatter of the fp32 gradients       (n-1)/n * 4 B * params
  (embeddings, value  all-gather of the fp32 parameter slices     (n-1)/n * 4 B * params
  embeddings, lm_head)
  small AdamW tensors all-reduce of the fp32 gradients            2(n-1)/n * 4 B * params (latency-bound, ignored)
The reduce-scatters are what overlap can hide: they start during the backward of the last micro-batch.
The all-gathers follow the updates in step() and stay exposed in both cases.
  before = t_reduce_scatter + t_all_gather
  after  = max(0, t_reduce_scatter - t_backward_last_micro) + t_all_gather
with t_backward_last_micro = (2/3) * step compute time / grad_accum (backward = 2x forward FLOPs), the step
compute time = FLOPs/token * tokens per GPU / (MFU * peak). Batch: the recipe's (Power Lines, base_train's);
tokens per GPU = batch / GPUs; micro-batch 32 x 2048 tokens (smaller when a GPU's share is smaller, then
grad_accum = 1). Bus bandwidth: inside one node NVLink, across nodes each GPU's own NIC
(rail-optimized, NCCL's ring runs at about the per-GPU NIC rate), times an efficiency.

Needs nothing but this checkout (no GPU, no data): the parameter counts come from the model built on the meta
device, the batch and FLOPs per token from base_train's recipe (nanochat/recipe.py: derive_recipe).
"""

import torch

from dev import runs
from nanochat.gpt import GPT
from nanochat.optim import param_groups
from nanochat.recipe import parse_args, model_config, derive_recipe

VOCAB = 32768  # base_train's tokenizer's


def model_figures(depth):
    """(Muon params, large AdamW params, FLOPs per token, recipe batch in tokens) of a depth at base_train's
    defaults (its recipe: derive_recipe)."""
    args = parse_args([f"--depth={depth}"])
    config = model_config(args, VOCAB)
    recipe = derive_recipe(args, config)
    with torch.device("meta"):
        model = GPT(config)
    muon = adamw = 0
    for group in param_groups(model, 1, 1, 1, 1, 0):
        n = sum(p.numel() for p in group["params"] if group["kind"] == "adamw" and p.numel() < 1024)
        total = sum(p.numel() for p in group["params"])
        if group["kind"] == "muon":
            muon += total
        else:
            adamw += total - n
    return muon, adamw, recipe.flops_per_token, recipe.total_batch_size


def main(argv=None):
    parser = runs.argument_parser(__doc__)
    parser.add_argument("--depths", type=str, default="20,26", help="comma-separated depths")
    parser.add_argument("--nodes", type=str, default="1,2,8,64", help="comma-separated node counts")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    parser.add_argument("--nvlink-gbs", type=float, default=360.0, help="NVLink bus bandwidth inside a node, GB/s (H100 all-reduce busbw)")
    parser.add_argument("--ib-gbps", type=float, default=400.0, help="network per GPU across nodes, Gb/s")
    parser.add_argument("--efficiency", type=float, default=0.8, help="fraction of the link rate a ring reaches")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU (H100/H200)")
    parser.add_argument("--mfu", type=float, default=0.55, help="the compute's model FLOPs utilization")
    parser.add_argument("--micro-tokens", type=int, default=32 * 2048, help="tokens per micro-batch per GPU")
    args = parser.parse_args(argv)
    print(f"assumptions: {args.gpus_per_node} GPUs/node; NVLink busbw {args.nvlink_gbs:g} GB/s inside a node; "
          f"{args.ib_gbps:g} Gb/s per GPU across nodes; ring efficiency {args.efficiency:g}; "
          f"compute {args.mfu:.0%} MFU of {args.peak_tflops:g} TFLOP/s; fp32 gradients, bf16 Muon updates\n")
    print("| model | nodes | GPUs | batch (tokens) | tokens/GPU | grad accum | compute/step | bwd of last micro | "
          "reduce-scatter | all-gather | exposed before | exposed after | hidden |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for depth in (int(d) for d in args.depths.split(",")):
        muon, adamw, flops_per_token, batch = model_figures(depth)
        rs_bytes = 4 * (muon + adamw)
        ag_bytes = 2 * muon + 4 * adamw
        for nodes in (int(n) for n in args.nodes.split(",")):
            n = nodes * args.gpus_per_node
            bus = (args.nvlink_gbs if nodes == 1 else args.ib_gbps / 8) * 1e9 * args.efficiency
            ring = (n - 1) / n
            t_rs, t_ag = ring * rs_bytes / bus, ring * ag_bytes / bus
            tokens_per_gpu = batch / n
            grad_accum = max(1, round(tokens_per_gpu / args.micro_tokens))
            compute = flops_per_token * tokens_per_gpu / (args.mfu * args.peak_tflops * 1e12)
            bwd_last = (2 / 3) * compute / grad_accum
            before = t_rs + t_ag
            after = max(0.0, t_rs - bwd_last) + t_ag
            ms = lambda t: f"{t * 1e3:.1f} ms"
            print(f"| d{depth} ({(muon + adamw) / 1e6:.0f}M reduced) | {nodes} | {n} | {batch:,} | {tokens_per_gpu:,.0f} | "
                  f"{grad_accum} | {ms(compute)} | {ms(bwd_last)} | {ms(t_rs)} | {ms(t_ag)} | {ms(before)} | "
                  f"{ms(after)} | {(before - after) / before:.0%} |")
    print("\nexposed = time per step the GPUs wait on DP communication (before: all of it after the backward; "
          "after: the reduce-scatter past the last micro-batch's backward, plus the all-gathers)")


if __name__ == "__main__":
    main()
