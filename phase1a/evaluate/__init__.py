"""Validation: held-out metrics, batched greedy generation, answer extraction, the gate, and evaluations
during training."""
