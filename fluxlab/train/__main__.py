from fluxlab.train.train import main

main()
