"""The command line the kernel benches share: one micro-batch of a depth's training shape, each measurement the
median of `--repeats` timed calls."""

import argparse


def micro_batch_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--device-batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    return parser
