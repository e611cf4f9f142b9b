"""Rollout records exchanged between the data side, the actor and the trainer."""
