"""Promotion: a model that passed the gate stored as a new version, then the pointer moved to it (promotion.py);
reading the promoted versions is phase1a/store/promoted.py."""
