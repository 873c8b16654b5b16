"""Turning rvqstore caches into ``.rvq`` layer maps + sections and back (format 1.1 layer kinds, 1.2 codec state).

- :mod:`.encode`: caches -> layer maps, sections and the quantizer map(s)
- :mod:`.decode`: layer maps + sections -> caches
- :mod:`.resume_rules`: how far back each kind of layer can be rewound
- :mod:`.structure`: the cache kinds a model expects, checked against a file's layer maps
"""
