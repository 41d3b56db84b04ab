"""Print the planner's step time against published training runs (``lightning_mgpu.planner.calibration``): model,
GPUs, layout, published tokens/s per GPU, predicted, error; the calibration's assumptions in the header."""

from lightning_mgpu.planner.calibration import calibration_table

# --smoke (what make test runs) prints the same table: it takes well under a second.

if __name__ == "__main__":
    print(calibration_table())
