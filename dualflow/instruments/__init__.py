"""Research instruments: side-by-side measurements (`compare`, `demo`), the from-scratch study (`experiment`), and the
two-pass reference the tests use as an oracle. Not needed to convert, fine-tune, load or serve a model."""
