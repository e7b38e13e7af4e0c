"""Tools a policy calls while it writes: their JSON schemas, the calls parsed from a completion and run
(errors returned to the model), the token ids of a tool turn, and two tools (a calculator, a sandboxed
Python runner)."""
