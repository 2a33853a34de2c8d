from od_dist.cli import run

run()
