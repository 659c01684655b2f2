"""Does training learn? Real small datasets, generation from checkpoints, and classifier scores."""
