"""Print the flags of llama.cpp's llama-server, from its `--help` text on stdin.

    llama-server --help | python3 llama_server_flags.py > llama-server.txt

An option line starts at column 0 with its names, comma-separated (`-n,    --predict,
--n-predict N`); the first name without a trailing comma is the last one. Section headers
(`----- common params -----`) are not options.
"""

import re
import sys

FLAG = re.compile(r"-{1,2}[A-Za-z0-9][A-Za-z0-9._-]*")


def flags(help_text):
    found = set()
    for line in help_text.splitlines():
        if not line.startswith("-"):
            continue
        for word in line.split():
            if not FLAG.fullmatch(word.rstrip(",")):
                break
            found.add(word.rstrip(","))
            if not word.endswith(","):
                break
    return sorted(found)


if __name__ == "__main__":
    print("\n".join(flags(sys.stdin.read())))
