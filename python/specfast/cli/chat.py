"""`specfast chat`: an interactive loop over a Session that streams each reply.

Lines are messages; these are commands:
  /reset        forget the conversation (the system message stays)
  /rewind [N]   forget the last N turns (default 1)
  /stats        the last turn's speed, acceptance and cache reuse
  /quit         leave (so does end of input)
Ctrl-C during a reply drops that turn (the session stays as it was before it) and goes on.
`specfast serve` offers the same conversations to any OpenAI client (docs/serve.md).
"""

from __future__ import annotations

import sys
from typing import TextIO

from specfast.cli.common import format_stats

HELP = "commands: /reset, /rewind [N], /stats, /quit"


def chat_loop(session, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    """Reads messages from stdin until EOF or /quit; replies stream to stdout, the rest to
    stderr. Returns the exit status."""
    last = None
    interactive = stdin.isatty()
    while True:
        if interactive:
            stderr.write(">>> ")
            stderr.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, *args = line.split()
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/reset":
                session.reset()
                print("(conversation reset)", file=stderr)
            elif cmd == "/rewind":
                try:
                    n = int(args[0]) if args else 1
                    session.rewind(n)
                    print(f"(rewound {n} turn(s); {len(session.history)} left)", file=stderr)
                except ValueError as e:
                    print(f"error: {e}", file=stderr)
            elif cmd == "/stats":
                if last is None:
                    print("(no turn yet)", file=stderr)
                else:
                    print(format_stats(last.stats), file=stderr)
                    print(
                        f"prefill {last.stats.prefill_tokens} tokens, reused "
                        f"{last.stats.reused_tokens} from the cache; conversation "
                        f"{len(session.token_ids)} of {session.max_length} tokens, "
                        f"{len(session.history)} turn(s)",
                        file=stderr,
                    )
            else:
                print(f"unknown command {cmd!r}; {HELP}", file=stderr)
            continue

        def stream(text: str) -> None:
            stdout.write(text)
            stdout.flush()

        try:
            last = session.send(line, streamer=stream)
        except KeyboardInterrupt:
            print("\n(interrupted: that turn was dropped)", file=stderr)
            continue
        except ValueError as e:
            print(f"error: {e}", file=stderr)
            continue
        stdout.write("\n")
        stdout.flush()
    return 0


def main_chat(session) -> int:
    return chat_loop(session, sys.stdin, sys.stdout, sys.stderr)
