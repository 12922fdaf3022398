"""Pipeline parallelism: schedules as data (ops.py, spec.py, one ScheduleSpec per schedule, registered in
registry.py), the stages and their chunk orders (stage.py), a communication plan NCCL cannot deadlock on
(plan.py), one executor (executor.py) and this rank's pipeline (runner.py)."""
