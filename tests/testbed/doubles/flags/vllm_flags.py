"""Print the flags of `vllm serve`, from its `--help=all` text on stdin.

    vllm serve --help=all | python3 vllm_flags.py > vllm-0.32.0.txt

An option line of argparse's help is indented by two spaces and starts with `-`; its names are
the comma-separated words before the description (`-tp TENSOR_PARALLEL_SIZE,
--tensor-parallel-size TENSOR_PARALLEL_SIZE`). Wrapped description lines are indented further.
"""

import re
import sys


def flags(help_text):
    found = set()
    for line in help_text.splitlines():
        if not re.match(r"  -", line):
            continue
        spec = re.split(r"\s{2,}", line.strip())[0]
        for part in spec.split(", "):
            words = part.split()
            if words and words[0].startswith("-"):
                found.add(words[0])
    return sorted(found)


if __name__ == "__main__":
    print("\n".join(flags(sys.stdin.read())))
