// Package sock holds what the CSI mock stand-ins (e2e/storage/cmd) share about unix sockets.
package sock

import (
	"errors"
	"fmt"
	"os"
)

// RemoveStale deletes a socket an earlier instance left at path (a restarted container finds
// its predecessor's), so that a new listener can take the path. Anything that is not a socket
// is refused, never deleted.
func RemoveStale(path string) error {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil
	case err != nil:
		return err
	case fi.Mode()&os.ModeSocket == 0:
		return fmt.Errorf("%s exists and is not a socket", path)
	}
	return os.Remove(path)
}
