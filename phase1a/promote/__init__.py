"""Promoted versions, warm starts from them, and old data replayed beside the new."""
