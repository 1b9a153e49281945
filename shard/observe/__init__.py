"""What a run shows: the console, progress lines, metrics files and reports."""
