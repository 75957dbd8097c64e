from mtkit.launch import main

main()
