"""Episode generation: one episode (episode.py), many (generate.py), extra rewards (reward.py)."""
