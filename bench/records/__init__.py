"""Result rows and what is made of them: the JSONL record, trackers, statistics, tables, progress."""
