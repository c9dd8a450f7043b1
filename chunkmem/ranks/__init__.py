"""Ranks and their agreement: the collectives and side streams (``comm``), the cross-rank checks that
turn a departure into an error on every rank (``rank_checks``, ``rank_channel``, ``departure_search``,
``thread_activity``), and the values and outcomes ranks agree on (``agreed_values``, ``agreement``)."""
