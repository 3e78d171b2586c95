"""Speech this machine can make and hear: voices (espeak-ng, flite, festival), sentences, augmentation, and a
closed-set recogniser (pocketsphinx over a JSGF grammar) used as the oracle that hears what a reply says."""
