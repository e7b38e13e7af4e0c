"""Verifiable rewards: answer extraction and checks, calling reward functions, the step verifier, the
audit."""
