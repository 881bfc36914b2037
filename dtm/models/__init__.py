"""Reference models written with dtm.nn."""
