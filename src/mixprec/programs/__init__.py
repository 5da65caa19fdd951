"""The programs: ``mixprec`` cli, train, bench, doctor, inspect; they import the library only."""
