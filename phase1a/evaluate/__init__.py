"""Validation: held-out metrics, batched greedy generation, answer extraction, the gate, evaluations
during training, and whether vLLM can serve the adapter beside others (serving.py)."""
