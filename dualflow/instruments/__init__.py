"""
Research instruments, not needed to convert, fine-tune, load or serve a model: side-by-side measurements (`compare`:
`variants`, `two_pass`, `measure`, `probes`, `tables`, `plots`, `inputs`; `demo`), and the from-scratch study
(`experiment`, `tiny_lm`, `data`).
"""
