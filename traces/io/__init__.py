"""Reading and writing traces (and other tools' formats); every write atomic."""
