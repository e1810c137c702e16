"""
Research instruments, not needed to convert, fine-tune, load or serve a model: side-by-side measurements (`compare`:
`variants`, `two_pass`, `measure`, `probes`, `tables`, `plots`, `inputs`; `demo`), the from-scratch study
(`experiment`, `tiny_lm`, `data`), and the two-pass oracle the tests trust (`reference`).
"""
