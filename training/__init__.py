"""Training: data -> TFRecords -> input pipeline -> model -> train/eval -> export. It never imports serving."""

# The logger long jobs report progress on. `petal` keeps it at INFO even when every other log is quiet.
PROGRESS_LOGGER = "petal.progress"
