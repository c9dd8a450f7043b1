"""Planning: predict a run without running it (``planner``) and report it (``plan_report``). The command
line is ``chunkmem-plan`` (``python -m chunkmem.plan_command``)."""
