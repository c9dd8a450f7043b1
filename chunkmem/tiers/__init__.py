"""Tiers and transfers: every copy between host memory and the compute device (``transfers``), the
disk tier's files (``disk``), and the directories chunkmem makes among a user's files (``owned_dir``)."""
