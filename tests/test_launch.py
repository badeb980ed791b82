"""Every script flag survives torchrun's own parser: torchrun abbreviation-matches the options that follow the
script, so a script flag that is a prefix of two of its options (`--run` of --run-path and --run_path) stopped
`torchrun ... -m scripts.base_train --run=NAME` before it started."""

import re

import pytest
from torch.distributed.run import get_args_parser

from conftest import run_script, script_env

SCRIPTS = ["scripts.base_train", "scripts.base_eval", "scripts.sample", "scripts.tok_train", "scripts.tok_eval"]


def script_flags(module):
    """The --flags of a script, from its --help (in this process)."""
    p = run_script(module, ["--help"], script_env("/nonexistent"), check=False)
    assert p.returncode == 0, p.stderr
    assert "(default: " in p.stdout, f"{module} --help shows no defaults"
    return sorted(set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", p.stdout)) - {"--help"})


@pytest.mark.parametrize("module", SCRIPTS)
def test_every_flag_passes_through_torchrun(module):
    flags = script_flags(module)
    assert flags
    parser = get_args_parser()
    for flag in flags:
        for arg in (flag, f"{flag}=1"):
            try:
                parsed = parser.parse_args(["--standalone", "--nproc_per_node=2", "-m", module, arg])
            except SystemExit:
                pytest.fail(f"torchrun rejects {module}'s {arg} (it abbreviates one of torchrun's options): rename the flag")
            assert parsed.training_script_args == [arg], (module, arg)
