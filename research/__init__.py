"""Research instruments: how the gateway and the budget stores spend their work, measured to the
instruction (callgrind), to the Lua line (a sampling profile inside Redis), per Redis call, per
garbage collection and per round of service. Each runs as a module from a checkout
(``python -m research.<name> --help``); none ships in the package: they need valgrind, a Redis
built with symbols or an older checkout to compare with, and read the stores' internals. The
user-facing benchmarks are in ``loadtest/bench`` (docs/benchmarks.md).
"""
